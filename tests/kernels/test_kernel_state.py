"""Where the kernels come from is visible: a failed build is a loud warning with the compiler's first error and
its cost, every engine logs which kernels it runs on, and `kvserve doctor` says it all (exit 1 on a failure)."""

import logging

import pytest

from kvserve.kernels import build

# What torch's cpp_extension raises when a source does not compile (ninja's lines first, the compiler's after).
_NINJA_FAILURE = ("Error building extension 'kvserve_cpu_kernels_x': [1/4] c++ -MMD -MF paged_decode.o.d -O3 -c "
                  "paged_decode.cpp -o paged_decode.o\nFAILED: paged_decode.o\n"
                  "paged_decode.cpp:9:10: fatal error: kernels.h: No such file or directory\n"
                  "compilation terminated.\nninja: build stopped: subcommand failed.")


@pytest.fixture
def failed_build(monkeypatch):
    """A fresh state whose build fails as a package without csrc/kernels.h did."""
    import torch.utils.cpp_extension

    def load(**_):
        raise RuntimeError(_NINJA_FAILURE)

    monkeypatch.setattr(build, "_state", {})
    monkeypatch.delenv("KVSERVE_NO_CPP_KERNELS", raising=False)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)


def test_a_failed_build_warns_with_the_compilers_first_error_and_the_cost(failed_build, caplog):
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert build.cpu_kernels() is None
    warning = caplog.records[-1].getMessage()
    assert "RuntimeError: paged_decode.cpp:9:10: fatal error: kernels.h: No such file or directory" in warning
    assert "6x slower" in warning and caplog.records[-1].levelno == logging.WARNING
    state = build.kernel_state()
    assert state.failed and not state.available and "kernels.h: No such file" in state.describe()


def test_an_engine_logs_the_kernels_it_runs_on(tiny_models, caplog):
    from kvserve.config import EngineConfig
    from kvserve.engine.engine import Engine

    with caplog.at_level(logging.INFO, logger="kvserve.engine.setup"):
        Engine(EngineConfig(kv_cache_memory="4MiB"), loaded=tiny_models()).close()
    line = next(r for r in caplog.records if r.getMessage().startswith("kernels: "))
    state = build.kernel_state()
    assert line.getMessage() == f"kernels: {state.describe()}"
    assert line.levelno == (logging.WARNING if state.failed else logging.INFO)


def test_an_engine_on_a_failed_build_warns_which_paths_it_runs(failed_build, tiny_models, caplog):
    from kvserve.config import EngineConfig
    from kvserve.engine.engine import Engine

    with caplog.at_level(logging.INFO, logger="kvserve.engine.setup"):
        Engine(EngineConfig(kv_cache_memory="4MiB"), loaded=tiny_models()).close()
    line = next(r for r in caplog.records if r.getMessage().startswith("kernels: "))
    assert line.levelno == logging.WARNING
    assert line.getMessage().startswith("kernels: torch paths only: the C++ kernels failed to build (RuntimeError: "
                                        "paged_decode.cpp:9:10: fatal error")


def test_doctor_reports_the_installation(capsys):
    import torch

    from kvserve.cli import main
    from kvserve.doctor import package_version

    code = main(["doctor"])
    out = capsys.readouterr().out
    state = build.kernel_state()
    assert code == (1 if state.failed else 0)
    assert out.startswith(f"kvserve {package_version()} (")
    assert f"torch {torch.__version__}" in out and "\ncpu: " in out
    assert f"\nkernels: {state.describe()}\n" in out
    assert "\nmodel: embedded SmolLM2-135M-Instruct, " in out


def test_doctor_fails_on_a_failed_build_or_a_missing_model(failed_build, capsys):
    from kvserve.cli import main

    assert main(["doctor"]) == 1
    assert "kernels: torch paths only: the C++ kernels failed to build" in capsys.readouterr().out
    assert main(["doctor", "--model", "/no/such/model.gguf"]) == 1
    assert "model: /no/such/model.gguf: not found" in capsys.readouterr().out
