"""Small real models built here (no hub): shoal.train.repro's student and a byte-level BPE GPT-2, and
the project's scripted OpenAI-compatible server serving a model on /v1/completions."""
from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from shoal.annotate.demo_models import make_bpe_model, make_repro_checkpoint  # noqa: E402
from shoal.annotate.model import LocalModel  # noqa: E402
from shoal.rollout.scripted_server import spawn as spawn_scripted_server  # noqa: E402

# made once per machine (about 30 s on a loaded 2-core host), then reused: the makers are deterministic
# and write atomically; the version in the name changes when they do
MODELS = Path("/var/tmp/shoal-annotate-models/v1")


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """The tiny models run on one thread: a 2-core host shared with other tests is faster that way."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def repro_ckpt() -> Path:
    return make_repro_checkpoint(MODELS / "student-demo.pt")


@pytest.fixture(scope="session")
def bpe_dir() -> Path:
    return make_bpe_model(MODELS / "tiny-bpe")


@pytest.fixture(scope="session")
def bpe_long_model() -> LocalModel:
    """The same kind of model with 512 positions: room for an agent step, its tool output and more."""
    return LocalModel.load(make_bpe_model(MODELS / "tiny-bpe-512", n_positions=512))


@pytest.fixture(scope="session")
def repro_model(repro_ckpt) -> LocalModel:
    return LocalModel.load(repro_ckpt)


@pytest.fixture(scope="session")
def bpe_model(bpe_dir) -> LocalModel:
    return LocalModel.load(bpe_dir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ScriptedServer:
    """`python -m shoal.rollout.scripted_server --model PATH` on a free port, as a real process."""

    def __init__(self, model: Path):
        self.proc, self.url = spawn_scripted_server("--model", str(model), env={"OMP_NUM_THREADS": "1"})

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def scripted_server(bpe_dir):
    """In its own process: the tests that stop it mid-stream kill that process."""
    server = ScriptedServer(bpe_dir)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def scripted_server_inproc(bpe_dir):
    """The same app (scripted_server.make_app with a model) in a thread of this process: no second
    torch import, for the tests that only talk to it."""
    import threading

    import uvicorn

    from shoal.rollout.scripted_server import make_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(make_app(model=str(bpe_dir)), host="127.0.0.1", port=port,
                                           log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.05)
    server.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    yield server
    server.should_exit = True
    t.join(10)


class AppServer:
    """The annotation app on a free port (uvicorn in a thread), over a store and a model backend."""

    def __init__(self, store, backend, **kw):
        import threading

        import uvicorn

        from shoal.annotate.app import Annotator, make_app

        self.ann = Annotator(store, backend, **kw)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(make_app(self.ann), host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the annotation app did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


ARITH = ["265+988=", "776-430=", "497*006=", "123+456="]


@pytest.fixture
def ann_store(tmp_path):
    from shoal.annotate.tree import AnnotationStore

    store = AnnotationStore(tmp_path / "ann.db")
    for i, p in enumerate(ARITH):
        store.add_item(f"q{i}", {"text": p}, title=p)
    tokens = {}
    for name in ("alice", "bob"):
        tokens[name] = store.add_annotator(name)
        store.assign(name, store.items())
    store.tokens = tokens  # type: ignore[attr-defined]
    yield store
    store.close()


@pytest.fixture
def app_server(ann_store, repro_model):
    server = AppServer(ann_store, repro_model, k=8)
    yield server
    server.stop()
