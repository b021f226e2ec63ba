"""C2T's classifier (docs/algorithms.md section 4, seed 002): ``Linear(3, 48) ->
ReLU -> Linear(48, 1) -> sigmoid`` over a candidate's path probability
``P``, its parent's top-M entropy ``H`` and its depth ``d``; 241 parameters.

Stored as a small JSON file (no pickle, readable, a few kilobytes): the
weights, the entropy's ``top_m`` the features were computed with (the
drafter must compute the same), and how it was trained. Decision: no
feature scaling, as the spec allows; ``H`` is in nats and ``d`` a small
integer, both within the first layer's reach.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels.draft_distribution import MAX_M

FORMAT = "vllm-adaptive-spec/c2t-classifier"
FEATURES = ("path_probability", "parent_top_m_entropy", "depth")
HIDDEN = 48
FILE_NAME = "c2t_classifier.json"  # the default beside a draft model's weights


@dataclass
class C2TClassifier:
    w1: torch.Tensor  # [48, 3]
    b1: torch.Tensor  # [48]
    w2: torch.Tensor  # [48]
    b2: torch.Tensor  # []
    top_m: int = 1000
    trained: dict = field(default_factory=dict)

    @property
    def num_parameters(self) -> int:
        return sum(t.numel() for t in (self.w1, self.b1, self.w2, self.b2))

    def to(self, device) -> "C2TClassifier":
        return C2TClassifier(*(t.to(device) for t in (self.w1, self.b1, self.w2, self.b2)), self.top_m, self.trained)

    def save(self, path: str | Path) -> None:
        data = {
            "format": FORMAT,
            "features": list(FEATURES),
            "top_m": self.top_m,
            "w1": self.w1.tolist(),
            "b1": self.b1.tolist(),
            "w2": self.w2.tolist(),
            "b2": float(self.b2),
            "trained": self.trained,
        }
        Path(path).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")

    @staticmethod
    def load(path: str | Path) -> "C2TClassifier":
        """Read a classifier file; a ValueError that says what is wrong otherwise."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as error:
            raise ValueError(f"cannot read the C2T classifier file {str(path)!r}: {error.strerror}") from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError(f"{str(path)!r} is not a C2T classifier file (not JSON)") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{str(path)!r} is not a C2T classifier file (its 'format' is not {FORMAT!r})")
        if data.get("features") != list(FEATURES):
            raise ValueError(f"{str(path)!r}: features must be {list(FEATURES)}, got {data.get('features')!r}")
        try:
            classifier = C2TClassifier(
                torch.tensor(data["w1"], dtype=torch.float32),
                torch.tensor(data["b1"], dtype=torch.float32),
                torch.tensor(data["w2"], dtype=torch.float32),
                torch.tensor(float(data["b2"]), dtype=torch.float32),
                int(data["top_m"]),
                dict(data.get("trained", {})),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{str(path)!r}: malformed C2T classifier ({error!r})") from None
        shapes = (tuple(classifier.w1.shape), tuple(classifier.b1.shape), tuple(classifier.w2.shape))
        if shapes != ((HIDDEN, 3), (HIDDEN,), (HIDDEN,)) or not 1 <= classifier.top_m <= MAX_M:
            raise ValueError(
                f"{str(path)!r}: expected a 3-{HIDDEN}-1 network (w1 [{HIDDEN}, 3], b1 and w2 [{HIDDEN}]) and "
                f"top_m from 1 to {MAX_M}, got shapes {shapes} and top_m {classifier.top_m}"
            )
        return classifier

    @staticmethod
    def module_weights(module: torch.nn.Sequential) -> tuple[torch.Tensor, ...]:
        """``(w1, b1, w2, b2)`` of a trained ``Linear(3, 48), ReLU, Linear(48, 1)``."""
        first, _, last = module
        return (first.weight.detach().clone(), first.bias.detach().clone(),
                last.weight.detach()[0].clone(), last.bias.detach()[0].clone())
