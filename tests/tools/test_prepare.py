"""tools/prepare.py (`make setup`'s last step): a conversion that fails raises its own error, after the
preparations running beside it (the kernels' build, inductor's first compiles) have ended: none of them is
cut off by the interpreter's shutdown, where a compile fails with an error of its own."""
import threading
import time

import pytest

from phaseflip.engine.checkpoint import default_model
from phaseflip.graphs import compile as graphs_compile
from phaseflip.kernels.cpu import library
from phaseflip.tools import prepare


def test_a_failed_conversion_raises_after_the_preparations_beside_it_end(monkeypatch):
    ended = []

    def slow(what):
        def run(*_):
            time.sleep(0.3)
            ended.append(what)
        return run

    def fails():
        raise RuntimeError("the default model's GGUF is unreadable")

    def import_compiler(*_):
        thread = threading.Thread(target=slow("imports"))
        thread.start()
        return thread
    monkeypatch.setattr(default_model, "ensure_default_model", fails)
    monkeypatch.setattr(graphs_compile, "import_compiler", import_compiler)
    monkeypatch.setattr(library, "few_rows_op", slow("kernels"))
    monkeypatch.setattr(prepare, "_first_compiles", slow("headers"))
    monkeypatch.setattr(prepare.logging, "basicConfig", lambda **_: None)   # the suite's logging stays as it is
    with pytest.raises(RuntimeError, match="unreadable"):
        prepare.main()
    assert sorted(ended) == ["headers", "imports", "kernels"]
