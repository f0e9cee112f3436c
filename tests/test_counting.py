"""How the running sidecar counts prompt tokens: locally with the engine's own model's tokenizer.json,
tokenizing only when the count decides, and the engine's /tokenize only when opted in, on a connection
pool of its own. Real sidecar and fake engine on loopback."""

from __future__ import annotations

import asyncio
import io
import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from tests.harness import FakeEngine, _respond, eventually, lane, read_body, write_gpu_file

WORDS = ["the", "cat", "sat", "on", "the", "mat"]


def model_dir(tmp_path: Path) -> Path:
    """A model directory as SGLang loads it, with a word-level tokenizer.json (one token a word)."""
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    path = tmp_path / "model"
    path.mkdir()
    tokenizer.save(str(path / "tokenizer.json"))
    return path


class CountingEngine(FakeEngine):
    """FakeEngine plus ``/server_info`` (naming ``model_path``) and a ``/tokenize`` that records each
    call and answers only once ``tokenize_gate`` is set; ``scrapes`` counts /metrics reads."""

    def __init__(self, model_path: str = "/nonexistent/model") -> None:
        super().__init__(events=1)
        self.model_path = model_path
        self.tokenize_calls: list[dict[str, Any]] = []
        self.tokenize_gate = asyncio.Event()
        self.tokenize_gate.set()
        self.scrapes = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path")
        if path == "/server_info":
            info = {"version": "0.5.23", "model_path": self.model_path, "context_length": 100000}
            await _respond(send, 200, json.dumps(info).encode(), b"application/json")
        elif path == "/tokenize":
            body = json.loads(await read_body(receive))
            self.tokenize_calls.append(body)
            await self.tokenize_gate.wait()
            count = len(body["prompt"].split())
            await _respond(send, 200, json.dumps({"count": count}).encode(), b"application/json")
        else:
            if path == "/metrics":
                self.scrapes += 1
            await super().__call__(scope, receive, send)


def decisions(log: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.getvalue().splitlines() if line.strip()]


async def test_text_prompts_are_not_sent_to_the_engine_by_default(tmp_path: Path) -> None:
    engine = CountingEngine()
    async with lane(tmp_path, engine) as (url, _app, _), httpx.AsyncClient(timeout=10) as client:
        r = await client.post(url + "/generate", json={"text": "the cat sat on the mat"})
        assert r.status_code == 200
        chat = {"model": "m", "messages": [{"role": "user", "content": "the cat"}]}
        r = await client.post(url + "/v1/chat/completions", json=chat)
        assert r.status_code == 200
    assert engine.tokenize_calls == []


async def test_the_engines_model_tokenizer_counts_prompts(tmp_path: Path) -> None:
    model = model_dir(tmp_path)
    engine = CountingEngine(model_path=str(model))
    async with lane(tmp_path, engine) as (url, app, _), httpx.AsyncClient(timeout=10) as client:
        await eventually(lambda: app.counter.engine_tokenizer_source is not None)
        assert app.counter.engine_tokenizer_source == str(model / "tokenizer.json")
        r = await client.post(
            url.admin + "/admission/explain", json={"text": "the cat sat on the mat the mat"}
        )
        assert r.status_code == 200
        assert (r.json()["count_method"], r.json()["prompt_tokens"], r.json()["exact"]) == (
            "tokenizer",
            8,
            True,
        )
    assert engine.tokenize_calls == []


async def test_the_tokenizer_runs_only_when_the_bound_does_not_fit(tmp_path: Path) -> None:
    """Open gate: admitted on the strict bound (one token a byte), nothing tokenized. Tight gate (the
    bound does not fit, the exact count does): tokenized, admitted on the exact count."""
    text = " ".join(WORDS * 30)  # 180 words, 689 bytes: 180 tokens exactly, 697 at most
    engine = CountingEngine(model_path=str(model_dir(tmp_path)))
    log = io.StringIO()
    async with (
        lane(tmp_path, engine, app_kwargs={"decision_log": log}) as (url, app, gpu_file),
        httpx.AsyncClient(timeout=10) as client,
    ):
        await eventually(lambda: app.counter.engine_tokenizer_source is not None)
        r = await client.post(url + "/generate", json={"text": text, "stream": False})
        assert r.status_code == 200
        await eventually(lambda: len(decisions(log)) == 1)
        first = decisions(log)[0]
        assert (first["decision"], first["prompt_tokens"], first["exact"]) == ("admit", 689 + 8, False)

        # 1 KiB per chunk token (small_policy): 697 tokens need 697 KiB, 180 need 180 KiB.
        write_gpu_file(gpu_file, 400 * 1024)
        await eventually(lambda: app.admission.snapshot.gpu.free_bytes == 400 * 1024)
        r = await client.post(url + "/generate", json={"text": text, "stream": False})
        assert r.status_code == 200
        await eventually(lambda: len(decisions(log)) == 2)
        second = decisions(log)[1]
        assert (second["decision"], second["prompt_tokens"], second["exact"]) == ("admit", 180, True)


async def test_engine_tokenize_is_opt_in_and_never_starves_the_scraper(tmp_path: Path) -> None:
    """Opted in, with the bound not fitting so every prompt is asked about: while more /tokenize calls
    hang than the scraper's whole pool holds, /metrics is still read."""
    engine = CountingEngine()
    engine.tokenize_gate.clear()
    async with (
        lane(tmp_path, engine, free_mib=0, prompt__use_engine_tokenize=True) as (url, _, gpu_file),
        httpx.AsyncClient(timeout=30) as client,
    ):
        waiting = [
            asyncio.create_task(
                client.post(url + "/generate", json={"text": f"the cat {i}", "stream": False})
            )
            for i in range(8)
        ]
        await eventually(lambda: len(engine.tokenize_calls) == 8)
        seen = engine.scrapes
        await eventually(lambda: engine.scrapes >= seen + 3)
        write_gpu_file(gpu_file, 1024 * 1024 * 1024)
        engine.tokenize_gate.set()
        results = await asyncio.gather(*waiting)
        assert [r.status_code for r in results] == [200] * 8


async def test_a_reload_loads_the_tokenizer_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGHUP with a policy that names a tokenizer.json: loaded in a worker thread, then in force."""
    import sidecar.intake.tokens

    threads: list[threading.Thread] = []
    real = sidecar.intake.tokens.load_tokenizer

    def spy(path):  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread())
        return real(path)

    monkeypatch.setattr(sidecar.intake.tokens, "load_tokenizer", spy)
    policy_file = tmp_path / "policy.yaml"
    engine = CountingEngine()
    async with (
        lane(tmp_path, engine, app_kwargs={"policy_path": str(policy_file)}) as (url, app, _),
        httpx.AsyncClient(timeout=10) as client,
    ):
        data = app.admission.policy.model_dump(mode="json")
        data["prompt"]["tokenizer_path"] = str(model_dir(tmp_path) / "tokenizer.json")
        policy_file.write_text(yaml.safe_dump(data))
        await app.reload_from_file()
        assert app.policy_source.last_reload is not None and app.policy_source.last_reload.result == "applied"
        assert threads and threading.main_thread() not in threads
        r = await client.post(url.admin + "/admission/explain", json={"text": "the cat sat"})
        assert r.json()["count_method"] == "tokenizer"


async def test_the_pollers_never_wait_behind_request_work_in_the_default_executor(tmp_path: Path) -> None:
    """Every thread of the loop's default executor is taken by work that does not end (as a burst of
    500K-token bodies being parsed or tokenized takes them, for up to a second each): the engine's
    /metrics is still parsed and the GPU file still read, so the signals stay fresh."""
    engine = CountingEngine()
    release = threading.Event()
    async with lane(tmp_path, engine) as (_url, app, gpu_file):
        loop = asyncio.get_running_loop()
        # More than the default executor holds (min(32, cores + 4)): the rest wait in its queue.
        blocked = [loop.run_in_executor(None, release.wait) for _ in range(40)]
        try:
            before = app.admission.snapshot.engine.observed_at
            await eventually(lambda: app.admission.snapshot.engine.observed_at > before)
            write_gpu_file(gpu_file, 123 * 1024 * 1024)
            await eventually(lambda: app.admission.snapshot.gpu.free_bytes == 123 * 1024 * 1024)
        finally:
            release.set()
            await asyncio.gather(*blocked)
