"""The serve-load client: one request sent over HTTP (streamed or not), what
came back recorded as an :class:`~benchmarks.serving.workload.Outcome`; a
block of requests sent at a concurrency."""

from __future__ import annotations

import asyncio
import json
import time

from benchmarks.serving.workload import Job, Outcome


async def _send(session, base: str, job: Job) -> Outcome:
    import aiohttp

    outcome = Outcome(job.index, job.kind, started=time.monotonic())
    path = "/v1/chat/completions" if job.endpoint == "chat" else "/v1/completions"
    choices: dict[int, list[int]] = {}
    reasons: dict[int, str | None] = {}
    try:
        async with session.post(base + path, json=job.body) as response:
            outcome.status = response.status
            if response.status != 200:
                outcome.error = (await response.text())[:500]
                return outcome
            if not job.stream:
                data = await response.json()
                for choice in data["choices"]:
                    choices[choice["index"]] = list(choice.get("token_ids") or [])
                    reasons[choice["index"]] = choice.get("finish_reason")
                outcome.first_token = time.monotonic()
            else:
                chunks = 0
                async for raw in response.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[5:])
                    for choice in data.get("choices", []):
                        ids = choice.get("token_ids") or []
                        if ids:
                            now = time.monotonic()
                            outcome.first_token = outcome.first_token or now
                            outcome.token_times.append(now)
                        choices.setdefault(choice["index"], []).extend(ids)
                        if choice.get("finish_reason") is not None:
                            reasons[choice["index"]] = choice["finish_reason"]
                    chunks += 1
                    if job.disconnect_after is not None and chunks >= job.disconnect_after:
                        outcome.disconnected = True
                        response.close()
                        break
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        outcome.finished = time.monotonic()
    outcome.token_ids = [choices[i] for i in sorted(choices)]
    outcome.finish_reasons = [reasons.get(i) for i in sorted(choices)]
    return outcome


async def drive(base: str, jobs: list[Job], concurrency: int) -> list[Outcome]:
    import aiohttp

    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=1800)

    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def one(job: Job) -> Outcome:
            async with gate:
                return await _send(session, base, job)

        return await asyncio.gather(*(one(job) for job in jobs))
