"""The training prompt corpus: varied in topic and form, never the benchmark set.

The head must generalise beyond its corpus, so most prompts
are built around text that the installed software ships rather than around a
few templates: the Python standard library's docstrings and source (what a
function does, how to use it, explain / port / test this code), its language
reference (``pydoc_data.topics``), and, where present, the Debian
documentation and package descriptions of the machine (passages to summarise
or answer from, sentences to translate). General questions, advice, writing
tasks and generated arithmetic word problems cover the rest.

Stage 2 is written from the target's stage-1 answers: follow-up turns of a
conversation (the answer stays in the history), passages to summarise or
answer from, and translations back into English.

Decisions: every source is read in sorted order and sampled with a fixed
seed, so a machine with the same Python and the same Debian packages builds
the same prompts (the answers file records them all in any case); the
Debian sources are optional, so the corpus builds anywhere.
"""

from __future__ import annotations

import gzip
import importlib
import inspect
import random
import re
from functools import lru_cache
from pathlib import Path

TOPICS = (
    "photosynthesis", "black holes", "the water cycle", "plate tectonics", "vaccines", "the immune system",
    "climate change", "renewable energy", "solar panels", "wind turbines", "nuclear fission", "electric cars",
    "the internet", "public key cryptography", "machine learning", "neural networks", "databases", "compilers",
    "operating systems", "cloud computing", "the French Revolution", "the Roman Empire", "the printing press",
    "the industrial revolution", "the Silk Road", "ancient Egypt", "the Renaissance", "the Cold War",
    "inflation", "interest rates", "supply and demand", "stock markets", "budgeting", "compound interest",
    "sleep", "nutrition", "exercise", "meditation", "coffee", "tea", "bread baking", "composting",
    "honeybees", "coral reefs", "rainforests", "deserts", "volcanoes", "earthquakes", "hurricanes",
    "the moon", "Mars", "the solar system", "stars", "galaxies", "gravity", "magnetism", "electricity",
    "sound waves", "light", "rainbows", "DNA", "evolution", "cells", "bacteria", "viruses", "antibiotics",
    "the heart", "the brain", "memory", "language learning", "music theory", "jazz", "chess", "football",
    "the Olympics", "photography", "painting", "poetry", "novels", "libraries", "museums", "democracy",
    "elections", "taxes", "urban planning", "public transport", "bicycles", "airplanes", "trains", "ships",
    "bridges", "skyscrapers", "recycling", "plastic pollution", "oceans", "glaciers", "rivers", "forests",
    "birds", "cats", "dogs", "whales", "ants", "mushrooms", "gardening", "tomatoes", "rice", "chocolate",
    "cheese", "spices", "time zones", "calendars", "maps", "GPS", "batteries", "semiconductors", "lasers",
    "robots", "3D printing", "smartphones", "email", "password managers", "open source software",
    "the stock exchange", "insurance", "mortgages", "credit scores", "small businesses", "marketing",
    "job interviews", "public speaking", "negotiation", "time management", "remote work", "team meetings",
    "the Great Wall of China", "the Byzantine Empire", "the Aztecs", "the Vikings", "World War I",
    "the Apollo program", "the Hubble telescope", "quantum computing", "blockchain", "encryption",
    "version control", "unit testing", "regular expressions", "spreadsheets", "statistics", "probability",
    "geometry", "prime numbers", "fractions", "algebra", "calculus", "the Pythagorean theorem",
    "the periodic table", "acids and bases", "chemical reactions", "the carbon cycle", "soil", "weather forecasts",
    "tides", "earthquake safety", "first aid", "vitamins", "allergies", "the common cold", "dental care",
    "hiking", "camping", "running a marathon", "yoga", "swimming", "cycling in cities", "board games",
    "video games", "film making", "theatre", "opera", "the violin", "the guitar", "choirs", "sculpture",
    "architecture", "interior design", "fashion", "knitting", "woodworking", "pottery", "origami",
    "volunteering", "moving to a new city", "learning to drive", "saving money", "personal finance",
    "philosophy", "ethics", "logic", "mythology", "folk tales", "the Olympic Games", "human rights",
)

QA = (
    "Explain {t} in simple terms.", "What is the most important thing to know about {t}?",
    "Give me a short overview of {t}.", "Why does {t} matter? Answer in a few sentences.",
    "List five interesting facts about {t}.", "How would you explain {t} to a ten-year-old?",
    "What are common misconceptions about {t}?", "Describe the history of {t} briefly.",
    "What are the pros and cons of {t}?", "Write a short paragraph about {t}.",
    "How does {t} work?", "What is the difference between {t} and {u}?",
    "How are {t} and {u} related?", "What questions do experts still ask about {t}?",
    "Give three examples that illustrate {t}.", "What would a beginner's glossary of {t} contain?",
    "Compare {t} with {u} in a short table.", "What has changed about {t} in the last hundred years?",
    "Which careers involve {t}?", "Explain {t} using an analogy.", "What are the main parts of {t}?",
    "In one paragraph, what should every student know about {t}?", "Is {t} good or bad? Discuss both sides.",
    "What are the first three things to read about {t}?",
)

CHAT = (
    "I want to get better at {t}. Where should I start?",
    "My friend says {t} is boring. How can I convince them otherwise?",
    "I have a presentation about {t} tomorrow. Can you help me plan it?",
    "Can you recommend a weekend project related to {t}?",
    "I'm writing a blog post about {t}. Suggest a title and an outline.",
    "Write a short poem about {t}.", "Write a haiku about {t}.",
    "Write a short story for children in which {t} plays a part.",
    "Write an email to my {who} inviting them to a talk about {t}.",
    "Pretend you are a {role} and tell me what you think about {t}.",
    "Give me a four-week plan to learn the basics of {t}.",
    "I'm feeling nervous about {situation}. Any advice?",
    "My {who} and I disagree about {t}. How can we talk about it calmly?",
    "Write a product description for a book about {t}.",
    "Write a short dialogue between a {role} and a student about {t}.",
    "Suggest five creative names for a club about {t}.",
    "Write a tweet announcing a new podcast episode about {t}.",
    "What gift would you suggest for someone who loves {t}?",
    "Give me a short motivational speech about {situation}.",
    "Help me write a polite message declining an invitation to {situation}.",
)
WHO = ("manager", "neighbour", "sister", "teacher", "colleague", "grandfather", "landlord", "best friend")
ROLES = ("pirate", "detective", "chef", "astronaut", "librarian", "medieval knight", "robot", "tour guide",
         "sports coach", "journalist")
SITUATIONS = ("a job interview", "my first day at a new school", "a long flight", "a dentist appointment",
              "speaking in public", "moving abroad", "an exam next week", "a wedding speech", "a team project",
              "a difficult conversation with my boss")

LANGUAGES = ("Python", "JavaScript", "C", "Java", "Go", "Rust", "Python", "Python", "TypeScript", "C++")
WRITE_CODE = (
    "Write a {lang} function called {name} that does the following: {summary}",
    "Implement {name} in {lang}. Specification: {summary}",
    "I need a {lang} helper for this: {summary} Can you write it?",
    "How would you implement this in {lang}? {summary}",
    "Write {lang} code with comments for the following task: {summary}",
)
READ_CODE = (
    "Explain what this Python code does:\n\n```python\n{src}\n```",
    "Add comments to this Python function:\n\n```python\n{src}\n```",
    "Write two unit tests for this function:\n\n```python\n{src}\n```",
    "Rewrite this Python function in {lang}:\n\n```python\n{src}\n```",
    "Could anything go wrong with this code? Explain.\n\n```python\n{src}\n```",
    "Describe the inputs and outputs of this function.\n\n```python\n{src}\n```",
    "Simplify this code if you can, and say what you changed.\n\n```python\n{src}\n```",
)
READ_DOC = (
    "Here is the documentation of Python's `{name}`:\n\n{doc}\n\nExplain it in plain words.",
    "Give a short example of how to use `{name}` in Python. Its documentation says:\n\n{doc}",
    "What does `{name}` do? Its docstring says:\n\n{doc}",
    "Based on this documentation, when would I use `{name}`?\n\n{doc}",
    "Summarize the documentation of `{name}` for a beginner:\n\n{doc}",
)
CODE_MODULES = (
    "argparse", "base64", "bisect", "calendar", "colorsys", "configparser", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "difflib", "email.utils", "enum", "fnmatch", "fractions", "ftplib", "functools",
    "genericpath", "getopt", "glob", "gzip", "heapq", "hmac", "html", "html.parser", "http.cookies", "imaplib",
    "inspect", "ipaddress", "json", "json.decoder", "json.encoder", "locale", "logging", "mimetypes",
    "ntpath", "numbers", "operator", "optparse", "os", "pathlib", "pickle", "platform", "posixpath", "pprint",
    "queue", "quopri", "random", "re", "sched", "secrets", "shlex", "shutil", "smtplib", "socket", "statistics",
    "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "traceback",
    "types", "typing", "urllib.parse", "urllib.request", "uuid", "warnings", "wave", "weakref", "zipfile",
)

NAMES = ("Ana", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jamal", "Kate", "Liam",
         "Maya", "Noah", "Olga", "Pablo", "Rosa", "Sam", "Tariq", "Yuki")
ITEMS = ("apples", "books", "pencils", "stickers", "marbles", "cookies", "tickets", "coins", "cards", "eggs",
         "stamps", "shells", "bottles", "plants", "candles")
ASK = ("", " Show your steps.", " Explain your reasoning.", " Think step by step.", " Give only the answer.")

PHRASES = (
    "Good morning, how are you today?", "Where is the nearest train station?", "I would like a cup of coffee, please.",
    "The weather is beautiful today.", "Can you help me find my keys?", "We are going to the beach this weekend.",
    "This book is very interesting.", "What time does the museum open?", "My brother lives in a big city.",
    "Thank you very much for your help.", "I am learning to cook Italian food.", "The meeting starts at nine o'clock.",
    "How much does this jacket cost?", "Please close the window, it is cold.", "She plays the piano every evening.",
)
TARGET_LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese", "Dutch", "Chinese", "Japanese")
TRANSLATE = (
    "Translate into {lang}: \"{s}\"", "How do you say \"{s}\" in {lang}?",
    "Please translate this sentence into {lang}.\n\n{s}", "What is the {lang} for: {s}",
    "Translate the following from English to {lang}: {s}",
)

SUMMARIZE = (
    "Summarize the following text in two sentences.\n\n{passage}",
    "Rewrite the following text as a bulleted list of key points.\n\n{passage}",
    "Here is a text:\n\n{passage}\n\nGive it a title and a one-sentence summary.",
    "Explain this text to someone who is new to the subject.\n\n{passage}",
    "What are the three most important points of this text?\n\n{passage}",
    "{passage}\n\nTL;DR:",
    "Write a short abstract for the following text.\n\n{passage}",
)
PASSAGE_QA = (
    "Read the passage and answer the question.\n\nPassage: {passage}\n\nQuestion: What is the main idea of the passage?",
    "Passage: {passage}\n\nUsing only the passage above, list the facts it states about {t}.",
    "Context: {passage}\n\nQuote the sentence of the context that best explains {t}, then explain it.",
    "Context:\n{passage}\n\nAccording to the context, what is said about {t}?",
    "{passage}\n\nBased on the text above, answer: why is {t} mentioned?",
    "Answer from the document only.\n\nDocument: {passage}\n\nQuestion: What does the document say about {t}?",
)

FOLLOW_UPS = (
    "Can you make that shorter?", "Give me a concrete example.", "Explain the first point in more detail.",
    "Now write it as a numbered list.", "Can you translate your answer into Spanish?",
    "What would be a good next step?", "Summarize your answer in one sentence.",
    "Are there any exceptions or caveats?", "Rewrite that for a ten-year-old.", "Why is that?",
    "Thanks! Can you add a short conclusion?", "What sources could I read to learn more?",
)
CODE_FOLLOW_UPS = ("Can you add error handling?", "What is the time complexity?", "Write a test for it.",
                   "Explain the code line by line.", "How would you make it faster?")
MATH_FOLLOW_UPS = ("Can you check your answer another way?", "Explain it more simply.",
                   "What if the numbers were doubled?")
PASSAGE_CHARS = 1100


def first_stage(count: int, seed: int = 0) -> list[dict]:
    """``count`` prompts of the passage-free and document-based families, shuffled."""
    rng = random.Random(seed)
    prompts = [*_general(rng), *_code(rng), *_math(rng, 320), *_translation(rng, 220), *_documents(rng, 300)]
    rng.shuffle(prompts)
    return [_record(f"s1-{i:05d}", category, text) for i, (category, text) in enumerate(prompts[:count])]


def second_stage(answered: list[dict], count: int, seed: int = 1) -> list[dict]:
    """Prompts over the target's own stage-1 answers: a follow-up turn (the
    answer kept in the history), a passage to summarise or answer from, or a
    translation back into English; a third each, shuffled."""
    rng = random.Random(seed)
    pool = [a for a in answered if a["id"].startswith("s1-") and a["answer"].strip()]
    rng.shuffle(pool)
    prompts = []
    for i, source in enumerate(pool[:count]):
        answer = source["answer"].strip()
        kind = i % 3
        if source["category"] == "translation":
            prompts.append(_record(f"s2-{i:05d}", "translation",
                                   f"Translate this back into English:\n\n{answer}"))
        elif kind == 0 or len(answer) < 200:
            follow = {"code": CODE_FOLLOW_UPS, "math": MATH_FOLLOW_UPS}.get(source["category"], FOLLOW_UPS)
            history = [{"role": "user", "content": source["prompt"]}, {"role": "assistant", "content": answer}]
            prompts.append(_record(f"s2-{i:05d}", "chat", rng.choice(follow), history=history))
        elif kind == 1:
            prompts.append(_record(f"s2-{i:05d}", "summarization",
                                   rng.choice(SUMMARIZE).format(passage=answer[:PASSAGE_CHARS])))
        else:
            passage = answer[:PASSAGE_CHARS]
            prompts.append(_record(f"s2-{i:05d}", "rag",
                                   rng.choice(PASSAGE_QA).format(passage=passage, t=_term(passage, rng))))
    return prompts


def _general(rng: random.Random) -> list[tuple[str, str]]:
    out = []
    for t in TOPICS:
        for template in rng.sample(QA, 2):
            out.append(("qa", template.format(t=t, u=rng.choice(TOPICS))))
        for template in rng.sample(CHAT, 2):
            out.append(("chat", template.format(t=t, who=rng.choice(WHO), role=rng.choice(ROLES),
                                                situation=rng.choice(SITUATIONS))))
    return out


def _code(rng: random.Random) -> list[tuple[str, str]]:
    out = []
    for name, summary, doc, src in _stdlib_functions():
        lang = rng.choice(LANGUAGES)
        roll = rng.random()
        if roll < 0.35 and summary:
            out.append(("code", rng.choice(WRITE_CODE).format(lang=lang, name=name.rsplit(".", 1)[-1],
                                                              summary=summary)))
        elif roll < 0.7 and src:
            out.append(("code", rng.choice(READ_CODE).format(src=src, lang=lang)))
        elif doc:
            out.append(("qa", rng.choice(READ_DOC).format(name=name, doc=doc)))
    return out


def _math(rng: random.Random, count: int) -> list[tuple[str, str]]:
    def problem() -> str:
        a, b = rng.sample(NAMES, 2)
        item = rng.choice(ITEMS)
        x, y, z = rng.randint(2, 60), rng.randint(2, 15), rng.randint(1, 9)
        kinds = (
            f"{a} has {x} {item}. {b} gives {a} {y} more, then {a} gives away {z}. How many {item} does {a} have now?",
            f"A box holds {x} {item}. How many {item} are there in {y} boxes?",
            f"{a} buys {y} {item} at {z} dollars each and pays with a {y * z // 10 + 1}0-dollar bill. "
            f"How much change does {a} get?",
            f"What is {x} times {y} plus {z}?",
            f"{a} reads {y} pages a day. How many days does a {x * 10}-page book take?",
            f"A train travels {x * 10} km in {y} hours. What is its average speed?",
            f"Solve for n: {y}n + {z} = {y * x + z}.",
            f"What is {rng.choice((5, 10, 15, 20, 25, 40))} percent of {x * 20}?",
            f"A shirt costs {x + 10} dollars and is discounted by {rng.choice((10, 20, 25, 50))} percent. "
            f"What is the new price?",
            f"{a} is {y} years older than {b}. In {z} years their ages will add up to {2 * x + y + 2 * z}. "
            f"How old is {b} now?",
            f"A rectangle is {x} cm long and {y} cm wide. What are its area and perimeter?",
            f"A film starts at {rng.randint(1, 11)}:{rng.choice(('05', '15', '30', '45'))} and lasts {x + 60} minutes. "
            f"When does it end?",
            f"{a} saves {y} dollars a week. How many weeks until {a} can buy a bike that costs {x * 10} dollars?",
            f"A recipe for {z + 1} people needs {y * 50} grams of flour. How much flour is needed for {z + 5} people?",
            f"What is the next number in the sequence {x}, {x + y}, {x + 2 * y}, {x + 3 * y}?",
            f"{a} can paint a fence in {y} hours and {b} can paint it in {y + z} hours. "
            f"How long does it take them together?",
            f"The average of three numbers is {x}. Two of them are {y} and {z}. What is the third?",
            f"Compute {x * 7 + 13} multiplied by {y + 10}.",
            f"How many minutes are there in {y} hours and {x} minutes?",
            f"A bag has {y} red and {x} blue {item}. If one is drawn at random, what is the chance it is red?",
            f"{a} invests {x * 100} dollars at {z} percent simple interest per year. How much interest after {y} years?",
        )
        return rng.choice(kinds) + rng.choice(ASK)

    return [("math", problem()) for _ in range(count)]


def _translation(rng: random.Random, count: int) -> list[tuple[str, str]]:
    sentences = list(PHRASES) + _plain_sentences()
    return [("translation", rng.choice(TRANSLATE).format(lang=rng.choice(TARGET_LANGUAGES), s=rng.choice(sentences)))
            for _ in range(count)]


def _documents(rng: random.Random, count: int) -> list[tuple[str, str]]:
    passages = _passages()
    out = []
    for passage in rng.sample(passages, min(count, len(passages))):
        if rng.random() < 0.5:
            out.append(("summarization", rng.choice(SUMMARIZE).format(passage=passage)))
        else:
            out.append(("rag", rng.choice(PASSAGE_QA).format(passage=passage, t=_term(passage, rng))))
    return out


def _term(passage: str, rng: random.Random) -> str:
    """A word of the passage to ask about: one of its longer words."""
    words = sorted({w for w in re.findall(r"[A-Za-z][A-Za-z_-]{5,}", passage)})
    return rng.choice(words) if words else "the subject"


@lru_cache(maxsize=1)
def _stdlib_functions() -> list[tuple[str, str, str, str]]:
    """(qualified name, one-line summary, docstring, short source) of the
    public functions of ``CODE_MODULES`` that have a docstring."""
    out = []
    for module_name in CODE_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name, obj in _public_functions(module):
            doc = inspect.getdoc(obj) or ""
            if len(doc) < 40:
                continue
            summary = doc.split("\n\n")[0].replace("\n", " ").strip()
            summary = summary if 4 <= len(summary.split()) <= 40 and "(" not in summary.split()[0] else ""
            try:
                src = inspect.getsource(obj)
            except (OSError, TypeError):
                src = ""
            src = src if src.count("\n") <= 30 and len(src) <= PASSAGE_CHARS else ""
            out.append((f"{module_name}.{name}", summary, doc[:800], src))
    return out


def _public_functions(module) -> list[tuple[str, object]]:
    """The module's own public functions and its public classes' methods, by name."""
    out = []
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            out.append((name, obj))
        elif inspect.isclass(obj):
            out += [(f"{name}.{attr}", fn) for attr, fn in sorted(vars(obj).items())
                    if not attr.startswith("_") and inspect.isfunction(fn)]
    return out


@lru_cache(maxsize=1)
def _passages() -> list[str]:
    """Paragraph groups of at most ``PASSAGE_CHARS`` characters from the
    Python language reference, module docstrings, and (if present) Debian
    READMEs and package descriptions."""
    texts = []
    from pydoc_data.topics import topics

    texts += [topics[k] for k in sorted(topics)]
    for module_name in CODE_MODULES:
        try:
            texts.append(inspect.getdoc(importlib.import_module(module_name)) or "")
        except ImportError:
            continue
    texts += _debian_readmes()
    texts += _debian_descriptions()
    passages = []
    for text in texts:
        current = ""
        for para in re.split(r"\n\s*\n", text):
            para = para.strip()
            if not para or len(para) > PASSAGE_CHARS:
                continue
            if current and len(current) + len(para) + 2 > PASSAGE_CHARS:
                passages.append(current)
                current = ""
            current = f"{current}\n\n{para}" if current else para
        if len(current) >= 300:
            passages.append(current)
    return [p for p in passages if len(p) >= 300 and _mostly_text(p)]


def _mostly_text(text: str) -> bool:
    letters = sum(c.isalpha() or c.isspace() for c in text)
    return text.isascii() and letters >= 0.8 * len(text)


def _debian_readmes() -> list[str]:
    out = []
    for path in sorted(Path("/usr/share/doc").glob("*/README*")):
        try:
            raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
            out.append(raw.decode("utf-8"))
        except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
            continue
    return out


def _debian_descriptions() -> list[str]:
    status = Path("/var/lib/dpkg/status")
    if not status.is_file():
        return []
    out = []
    for block in status.read_text(encoding="utf-8", errors="replace").split("\n\n"):
        match = re.search(r"^Description: (.*(?:\n .*)*)", block, re.MULTILINE)
        if match:
            lines = [line.strip() for line in match.group(1).split("\n")]
            out.append("\n".join("" if line == "." else line for line in lines))
    return ["\n\n".join(out[i:i + 4]) for i in range(0, len(out), 4)]


@lru_cache(maxsize=1)
def _plain_sentences() -> list[str]:
    """Short plain sentences (first sentences of docstring summaries and package descriptions)."""
    candidates = [summary for _, summary, _, _ in _stdlib_functions() if summary]
    candidates += [text.split("\n")[0] for text in _debian_descriptions()]
    out = []
    for text in candidates:
        sentence = text.split(". ")[0].strip().rstrip(".")
        if 5 <= len(sentence.split()) <= 16 and re.fullmatch(r"[A-Za-z ,'-]+", sentence):
            out.append(sentence[0].upper() + sentence[1:] + ".")
    return sorted(set(out))


def _record(prompt_id: str, category: str, text: str, history: list[dict] | None = None) -> dict:
    record = {"id": prompt_id, "category": category, "prompt": text}
    if history:
        record["history"] = history
    return record
