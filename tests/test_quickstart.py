"""Every Python block of the docs runs as written, with the bundled models and a fresh chunk store,
except a known list of fragments that cannot run in CI, each with its reason.

Each ``python`` block of README.md and docs/quickstart.md runs in its own interpreter, and the
``cacheblend-rag`` command lines of their ``bash`` blocks in a shell, from the repository root, with
``CACHEBLEND_RAG_HOME`` pointing at an empty folder whose ``models`` is the real converted-model
cache: the chunk store starts empty (as on a fresh machine) without converting the GGUF again.

The other pages' blocks (PROGRAMS) run in one interpreter for all of them, each program in a fresh
namespace (the modules stay imported, which saves their import per block): a program is one block,
or a block and the block it continues, joined in the order given. ``HOME`` is an empty folder too,
so a block's ``~/.cache/...`` path is the fresh one. A Redis URL of the docs names a shared server
(``cache.internal``): the executed copy names a throw-away ``redis-server`` instead. The server page's
clients talk to ``cacheblend-rag serve --served-model-name smollm2``, started here as the page says,
on port 8000 (or, where that port is taken, another one, which the executed copy names).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from cacheblend_rag.model.loading import default_cache_dir

sys.path.insert(0, str(Path(__file__).parent / "reliability_helpers"))
from local_redis import REDIS_SERVER, RedisServer

ROOT = Path(__file__).resolve().parents[1]
RUN = (ROOT / "README.md", ROOT / "docs" / "quickstart.md")  # pages whose blocks run as written, one per interpreter
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)

# The other pages' Python blocks that run, by page: each program is a tuple of blocks, each named
# by a line only that block of the page has, run joined (a block that continues the one before it).
PROGRAMS = {
    "choosing.md": [
        ("# bundled SmolLM2-135M-Instruct", "recompute_ratio=0.3)  # per call"),  # the second uses the first's engine
        ("BlendConfig(guard_margin=0.5)",),
        ("BlendConfig(escalation=",),
    ],
    "quality.md": [("engine.precompute(corpus_chunks, neighbours=2)",)],
    "sharing.md": [('store=["disk", "redis://cache.internal:6379/0"]',), ("RedisConfig(",)],
    "sources.md": [('print(result.stats["chunk_attention"])',)],
    "storage.md": [
        ('kv_format="float"',),
        ("TieredStore.memory_over_disk(", "LoadingController.for_engine(engine)"),  # the second uses the first's engine
    ],
    "throughput.md": [("with Batcher(engine", "CacheBlendLLM(engine=engine, max_batch=8)")],  # the same
    "server.md": [("response_format=",), ("stream=True",), ("ChatOpenAI(",)],
}
# What the executed copy names instead, per page: the URL of a shared Redis or of the server.
REDIS_URLS = ("redis://cache.internal:6379/0", "rediss://cacheblend:PASSWORD@cache.internal:6380/0")
SERVER_URL = "http://127.0.0.1:8000"

# Python blocks that do not run in CI, by page and first line, with why: a new block must run (on a
# page of RUN or in PROGRAMS) or be added here with its reason.
FRAGMENTS = {
    ("cluster.md", "from ray import serve"): (
        "four replicas of the model on a Ray cluster with a Redis server shared by its machines: more "
        "CPUs, memory and minutes than CI has; tests/test_cluster_ray.py runs build_app on a local Ray "
        "(two tiny replicas over a throw-away Redis)"
    ),
}

pytestmark = pytest.mark.slow


def _fenced(page: Path) -> list[tuple[str, str]]:
    return FENCE.findall(page.read_text(encoding="utf-8"))


def _blocks() -> list[tuple[str, str]]:
    runnable = []
    for page in RUN:
        for lang, body in _fenced(page):
            if lang == "python":
                runnable.append(("python", body))
            elif lang == "bash":
                runnable += [("bash", line) for line in body.splitlines() if line.startswith("cacheblend-rag ")]
    return runnable


BLOCKS = _blocks()


def test_the_pages_have_the_blocks_this_test_runs():
    kinds = [kind for kind, _ in BLOCKS]
    assert kinds.count("python") >= 4 and kinds.count("bash") >= 2, BLOCKS


def _python_blocks(page: str) -> list[str]:
    return [body for lang, body in _fenced(ROOT / "docs" / page) if lang == "python"]


def _program_blocks(page: str) -> list[tuple[str, ...]]:
    """PROGRAMS[page] with each block's name resolved to its text: every name in exactly one block."""
    blocks = _python_blocks(page)
    resolved = []
    for program in PROGRAMS[page]:
        texts = []
        for name in program:
            hits = [b for b in blocks if name in b]
            assert len(hits) == 1, f"{page}: {len(hits)} Python blocks hold {name!r} (PROGRAMS names one)"
            texts.append(hits[0])
        resolved.append(tuple(texts))
    return resolved


def test_every_other_python_block_runs_or_is_a_known_fragment():
    """Every Python block outside the run pages is in PROGRAMS (named once) or on FRAGMENTS (it
    cannot run in CI, for the reason given), not both; every entry of either is still on its page."""
    found, running = set(), set()
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page in RUN:
            continue
        blocks = _python_blocks(page.name)
        found |= {(page.name, b.strip().splitlines()[0]) for b in blocks}
        if page.name in PROGRAMS:
            running |= {(page.name, b.strip().splitlines()[0]) for program in _program_blocks(page.name) for b in program}
    assert not set(PROGRAMS) - {p.name for p in (ROOT / "docs").glob("*.md")}, "PROGRAMS names a page that is gone"
    assert sorted(found - running - set(FRAGMENTS)) == [], "Python blocks that no test runs: run them or list them in FRAGMENTS"
    assert sorted(set(FRAGMENTS) - found) == [], "FRAGMENTS lists blocks the pages no longer have"
    assert sorted(set(FRAGMENTS) & running) == [], "blocks both run and listed as fragments"
    for page, urls in (("sharing.md", REDIS_URLS), ("server.md", (SERVER_URL,))):
        text = (ROOT / "docs" / page).read_text(encoding="utf-8")
        assert all(url in text for url in urls), f"{page} no longer names {urls}: update what the executed copy replaces"


def _env(base: Path) -> dict[str, str]:
    """Environment of a block: an empty cache home over the real converted models, the repository
    and its integrations importable."""
    home = base / "home"
    home.mkdir(parents=True)
    models = default_cache_dir() / "models"
    models.mkdir(parents=True, exist_ok=True)
    (home / "models").symlink_to(models, target_is_directory=True)
    paths = [
        str(ROOT),
        str(ROOT / "integrations" / "langchain-cacheblend"),
        str(ROOT / "integrations" / "llama-index-cacheblend"),
    ]
    return {
        **os.environ,
        "CACHEBLEND_RAG_HOME": str(home),
        "PYTHONPATH": os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]),
    }


@pytest.fixture
def env(tmp_path):
    return _env(tmp_path)


@pytest.mark.parametrize("kind, code", BLOCKS, ids=[f"{k}-{i}" for i, (k, _) in enumerate(BLOCKS)])
def test_quickstart_block_runs(kind, code, env):
    cmd = [sys.executable, "-c", code] if kind == "python" else ["bash", "-c", code]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{kind} block failed:\n{code}\n--- stderr ---\n{done.stderr[-4000:]}"
    assert done.stdout.strip(), f"{kind} block printed nothing:\n{code}"


# ---------------------------------------------------------------------- the other pages' programs
MARK = "\x1e program "  # starts each program's output
FAILED = "\x1e failed"  # a program raised: its traceback follows
# Runs the programs given as JSON on stdin: each in a fresh namespace, its blocks in order; ``before``
# is harness code run (in a copy of the namespace) before a block. It ends with os._exit: after all
# these programs, with a dozen engines (and their store and batcher threads) created in one process,
# the interpreter's exit has aborted ("terminate called without an active exception", SIGABRT),
# though each page's blocks run alone exit cleanly.
DRIVER = f"""
import gc, json, os, sys, traceback
for program in json.load(sys.stdin):
    print({MARK!r} + program["name"], flush=True)
    namespace = {{"__name__": "__main__"}}
    try:
        for block, before in zip(program["blocks"], program["before"]):
            if before:
                exec(before, dict(namespace))
            exec(compile(block, program["name"], "exec"), namespace)
    except BaseException:
        print({FAILED!r}, flush=True)
        traceback.print_exc(file=sys.stdout)
    sys.stdout.flush()
    del namespace
    gc.collect()
sys.stdout.flush()
os._exit(0)  # every output is in: skip the teardown of the engines' threads (see DRIVER's comment)
"""
# Before storage.md's controller block: a short profile of the engine's model on this machine, where
# the controller reads it (a full profile, measured on first use, takes a minute; test_controller.py
# tests that path), so the block takes the second use's path.
QUICK_PROFILE = """
from cacheblend_rag.control.device_profile import default_profile_path
from cacheblend_rag.control.profiler import profile_engine

profile_engine(
    engine, lengths=(16, 64), tier_tokens=16, repeats=1, fused_tokens=64, fused_ratios=(0.15,), fused_chunks=2
).save(default_profile_path(engine))
"""
BEFORE = {("storage.md", "LoadingController.for_engine(engine)"): QUICK_PROFILE}
SERVER_WAIT_S = 300.0  # longest wait for the server's /health (it loads the model first)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_programs(pages: list[str], env: dict[str, str], replace: dict[str, str]) -> dict[str, str]:
    """Run ``pages``' programs in one interpreter; each program's stdout by its name."""
    programs = []
    for page in pages:
        for i, (names, blocks) in enumerate(zip(PROGRAMS[page], _program_blocks(page))):
            texts = list(blocks)
            for old, new in replace.items():
                texts = [b.replace(old, new) for b in texts]
            before = [BEFORE.get((page, name)) for name in names]
            programs.append({"name": f"{page} #{i}", "blocks": texts, "before": before})
    done = subprocess.run(
        [sys.executable, "-c", DRIVER],
        input=json.dumps(programs),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, f"the driver failed:\n{done.stdout[-4000:]}\n--- stderr ---\n{done.stderr[-4000:]}"
    outputs = {}
    for part in done.stdout.split(MARK)[1:]:
        name, _, out = part.partition("\n")
        outputs[name] = out
    assert sorted(outputs) == sorted(p["name"] for p in programs), done.stdout[-4000:]
    return outputs


@pytest.fixture(scope="module")
def doc_outputs(tmp_path_factory):
    """Every PROGRAMS page's programs run once (a Redis for sharing.md's, the server for server.md's):
    their outputs by program name, and what the Redis holds afterwards."""
    tmp = tmp_path_factory.mktemp("doc-programs")
    env = _env(tmp / "client")
    (tmp / "user").mkdir()
    env["HOME"] = str(tmp / "user")  # a block's ~/... path is a fresh folder
    server_env = _env(tmp / "server")
    port = 8000 if _port_free(8000) else _free_port()
    cli = shutil.which("cacheblend-rag")
    cmd = [cli] if cli else [sys.executable, "-c", "import sys; from cacheblend_rag.cli import main; sys.exit(main())"]
    cmd += ["serve", "--served-model-name", "smollm2"] + ([] if port == 8000 else ["--port", str(port)])
    log = (tmp / "serve.log").open("w")
    server = subprocess.Popen(cmd, cwd=ROOT, env=server_env, stdout=log, stderr=subprocess.STDOUT)  # loads while the rest runs
    redis = (
        RedisServer(tmp / "redis", "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru").start() if REDIS_SERVER else None
    )
    try:
        pages = [p for p in PROGRAMS if p != "server.md" and (p != "sharing.md" or redis)]
        outputs = _run_programs(pages, env, dict.fromkeys(REDIS_URLS, redis.url) if redis else {})
        keys = None
        if redis:
            import redis as redis_py

            keys = redis_py.Redis.from_url(redis.url).keys("*")
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + SERVER_WAIT_S
        while True:
            assert server.poll() is None, "serve exited:\n" + (tmp / "serve.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as res:
                    if res.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "serve did not answer /health:\n" + (tmp / "serve.log").read_text()[-4000:]
            time.sleep(0.5)
        outputs |= _run_programs(["server.md"], env, {SERVER_URL: url})
        yield {"outputs": outputs, "redis_keys": keys}
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
        if redis:
            redis.stop()


def _lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.strip()]


def _check_choosing(out):
    model, ratio = _lines(out[0])[:2]  # then the rest of the answer, if it has more lines
    assert model == "SmolLM2-135M-Instruct (bundled)"
    assert ratio.startswith("0.3 ") and ratio[4:].strip()  # the ratio the call named, and an answer
    margin, escalated = out[1].split()
    assert float(margin) >= 0 and escalated in ("True", "False")
    assert out[2].startswith("[0.15")  # the cascade's first step is the default ratio


def _check_quality(out):
    *text, hits = out[0].rsplit(" ", 1)
    assert text[0].strip() and int(hits) >= 0


def _check_sources(out):
    shares = json.loads(out[0])
    assert len(shares) == 2 and abs(sum(shares) - 1) < 1e-3


def _check_storage(out):
    assert out[0] == ""
    ratio, text = out[1].strip().split(" ", 1)
    assert 0.15 <= float(ratio) <= 1 and text.strip()  # picked by the controller, at its floor or above


def _check_throughput(out):
    *texts, answers, per_step = _lines(out[0])
    assert len(texts) >= 2  # the two tickets' answers
    assert answers.startswith("[") and 1 <= float(per_step) <= 8


def _check_server(out):
    assert isinstance(json.loads(out[0])["answer"], str)  # the schema's object
    usage = re.search(r"^(\d+) (\S+)$", out[1], re.M)  # cached tokens and TTFT, between the two answers
    assert usage and int(usage[1]) >= 0 and float(usage[2]) > 0, out[1]
    assert out[1][: usage.start()].strip() and out[1][usage.end() :].strip()
    answer, cache_read = out[2].strip().rsplit(" ", 1)
    assert answer.strip() and int(cache_read) >= 0


CHECKS = {
    "choosing.md": _check_choosing,
    "quality.md": _check_quality,
    "sharing.md": lambda out: out == ["", ""],
    "sources.md": _check_sources,
    "storage.md": _check_storage,
    "throughput.md": _check_throughput,
    "server.md": _check_server,
}


@pytest.mark.parametrize("page", sorted(PROGRAMS))
def test_doc_page_blocks_run(page, doc_outputs):
    """The page's programs ran without an error, and what they printed is what the page says."""
    if page == "sharing.md" and doc_outputs["redis_keys"] is None:
        pytest.skip("redis-server not found on PATH (apt-get install redis-server)")
    outputs = [doc_outputs["outputs"][f"{page} #{i}"] for i in range(len(PROGRAMS[page]))]
    failed = [out for out in outputs if FAILED in out]
    assert not failed, f"{page}: a program failed:\n" + "\n".join(failed)
    assert CHECKS[page](outputs) is not False, outputs
    if page == "sharing.md":  # the first program's chunk reached Redis, under the default prefix
        assert any(k.startswith(b"cacheblend:") for k in doc_outputs["redis_keys"]), doc_outputs["redis_keys"]
