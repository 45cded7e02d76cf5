"""Session-wide fixtures: tiny random checkpoints built once per test session (see tests/models.py); the
private cache; the CPU kernels built for the tests that call them (`cpu_kernels`: at the first such
test, not at collection, when the private cache is set), or those tests skipped where they cannot build;
the subprocess-bound work started at the session's start to run beside the others (tests/background.py)."""
from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
from pathlib import Path

import pytest

from phaseflip.graphs.compile import cache_dirs
from tests import background
from tests.models import make_tiny_model, make_tokenizer


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    """Nothing a test does touches the user's cache ($PHASEFLIP_CACHE or ~/.cache/phaseflip: the last
    boot's manifest, compiled code): the session's cache is a temp dir. The default model that `make`
    converted there is only read, through a link (converted anew into the temp dir when absent); so are
    the CPU kernels `make` built there (each file named by what it was built from: a changed source
    builds anew, into the temp dir). Compiled graphs go to one suite-wide dir in the system's temp dir
    (unless the user named inductor's and Triton's): a session that compiled every graph cold would not
    fit the suite's 10 minutes; inductor keys its entries by what they were compiled from."""
    from phaseflip.cache import cache_dir
    from phaseflip.engine.checkpoint.default_model import DEFAULT_MODEL_NAME, is_complete
    users = cache_dir()
    private = tmp_path_factory.mktemp("phaseflip-cache")
    if is_complete(users / DEFAULT_MODEL_NAME):
        (private / DEFAULT_MODEL_NAME).symlink_to(users / DEFAULT_MODEL_NAME, target_is_directory=True)
    if (users / "kernels").is_dir():
        (private / "kernels").mkdir()
        for built in (users / "kernels").glob("*.so"):
            (private / "kernels" / built.name).symlink_to(built)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PHASEFLIP_CACHE", str(private))
        mp.setenv("PHASEFLIP_RANK_TEMPLATE_IDLE_S", "60")   # warm across the suite's boots, not 3 s
        for name, path in cache_dirs(os.path.join(tempfile.gettempdir(), "phaseflip-tests-compile")).items():
            mp.setenv(name, path)
        yield users


@pytest.fixture(scope="session")
def cpu_kernels():
    """kernels/cpu/library.py with its kernels loaded; skipped without Linux and g++, where they cannot
    build (with both, they must)."""
    from phaseflip.kernels.cpu import library
    if library.few_rows_op() is None and (platform.system() != "Linux" or shutil.which("g++") is None):
        pytest.skip(f"no CPU kernels here: {library.kernel_report()['reason']}")
    assert library.few_rows_op() is not None, library.kernel_report()
    return library


@pytest.fixture(autouse=True, scope="session")
def _cpu_by_default():
    """The suite's engines run on the CPU unless a test asks for device="cuda" itself (tests/graphs/
    test_cuda.py, marked): on a CUDA machine, device="auto" would move tests that assert CPU-only
    properties (oneDNN GEMMs, gloo, the measured compile choice, host memory) onto the GPU."""
    from phaseflip.engine import boot
    resolve = boot.resolve_device
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(boot, "resolve_device", lambda device: resolve("cpu" if device == "auto" else device))
        yield


@pytest.fixture(autouse=True, scope="session")
def _eager_by_default():
    """Engines the tests build run eager unless a test asks for compile: inductor compiles for seconds
    per layout on 2 cores (tests of the compiled path pass compile= themselves)."""
    old = os.environ.get("PHASEFLIP_COMPILE")
    os.environ["PHASEFLIP_COMPILE"] = "off"
    yield
    if old is None:
        os.environ.pop("PHASEFLIP_COMPILE", None)
    else:
        os.environ["PHASEFLIP_COMPILE"] = old


@pytest.fixture(scope="session")
def compiled_cache(tmp_path_factory):
    """A phaseflip cache for the tests of the compiled path, cold at the first: later boots of the same
    model and step widths load the steps it compiled (graphs/saved_steps.py), as a second boot would;
    their records (by their own buckets) stay apart."""
    return tmp_path_factory.mktemp("compiled-cache")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: tiny_model_dir("qwen2", tie=True, sharded=True) -> Path, built once per argument set.

    The directories are shared by every test in the session: treat them as read-only (copy one with
    shutil.copytree before corrupting it).
    """
    cache: dict[tuple, Path] = {}

    def build(kind: str, **options) -> Path:
        key = (kind, tuple(sorted(options.items())))
        if key not in cache:
            name = "-".join([kind] + [f"{k}={v}" for k, v in key[1]])
            cache[key] = make_tiny_model(kind, tmp_path_factory.mktemp(name), **options)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """A directory holding only the tiny test tokenizer (tokenizer.json + tokenizer_config.json)."""
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded default model (SmolLM2-135M-Instruct), converted once into the cache by `make`."""
    from phaseflip.engine.checkpoint.default_model import ensure_default_model
    return ensure_default_model()


@pytest.fixture(scope="session")
def smollm_reference(default_model_dir, _background_jobs):
    """(model_dir, 8 prompts' token ids, HF greedy reference of 32 tokens each), computed once, in the
    background (tests/hf_reference.py)."""
    out = json.loads(_background_jobs["smollm_reference"].stdout("HF's reference"))
    return default_model_dir, out["prompts"], [tuple(r) for r in out["reference"]]


@background.register("smollm_reference")
def _hf_reference_of_smollm(session: background.Session) -> background.Job:
    return background.python("-m", "tests.hf_reference", str(session.fixture("default_model_dir")), "32")


@pytest.fixture(autouse=True, scope="session")
def _background_jobs(request, tmp_path_factory, _private_cache, _eager_by_default):
    """fixture name -> background.Job (or a tuple of them): the subprocess-bound work of the tests this
    session selected (registered with background.register), run from now on, one after the other (in
    the session's environment: its private cache, eager engines), and collected by the fixture of that
    name (tests/background.py says why)."""
    jobs = background.start(background.Session(request.session.items, request.getfixturevalue,
                                               tmp_path_factory.mktemp))
    yield jobs
    background.kill(jobs)


@pytest.fixture
def default_few_rows():
    """Each GGUF block format's few-rows limit (kernels/cpu/few_rows.h) back to its default after the test:
    a limit a test or an in-process boot sets stays set in the CPU kernels for the tests after it."""
    yield
    from phaseflip.kernels.cpu import quant
    for fmt in quant.FORMATS.values():
        quant.set_few_rows(fmt, None)


@pytest.fixture
def int8_products():
    """quant.set_int8_x, the products on GGUF blocks' process setting (int8 x or exact), put back as it was
    after the test: a setting a test or an in-process boot makes stays for the tests after it."""
    from phaseflip.kernels.cpu import quant
    before = quant.int8_x()
    yield quant.set_int8_x
    quant.set_int8_x(before)


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run tests marked slow (the full matrix; `make test-slow`)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow") or os.environ.get("PHASEFLIP_SLOW") == "1":
        return
    for item in items:
        slow = item.get_closest_marker("slow")
        if slow is not None:
            why = slow.kwargs.get("reason", "minutes on 2 cores")
            item.add_marker(pytest.mark.skip(reason=f"marked slow ({why}): run with --runslow or `make test-slow`"))
