"""The command line as a user meets it: every mistake in a flag or in a checkpoint file is
one line on stderr naming the flag or the file, with exit status 2 and no traceback; Ctrl-C
is one line and status 130; ``info`` reports the build; the demo's pool and position checks
refuse exactly what the engine would refuse.

Each subprocess pays one JAX import (about half a second); the model options below keep
any run that gets as far as serving to a couple of seconds on two cores.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxattn import native
from jaxattn.__main__ import _cuda_fit, info, main
from jaxattn.engine import Engine
from jaxattn.engine.workload import make_workload
from jaxattn.models import llama

_TINY = "--layers 1 --hidden 32 --heads 2 --kv-heads 1 --vocab 64 --system-tokens 16 --chats 1"
_TINY += " --turns 2 --few-shot 1 --example-tokens 8 --max-new-tokens 4 --page-size 4"
TINY = [*_TINY.split(), "--max-batch-tokens", "32", "--quiet"]


def run_cli(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "jaxattn", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def assert_usage_error(result, *names):
    """Status 2, nothing on stdout, one line on stderr that names every one of ``names``."""
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert len(lines) == 1, lines
    assert result.stdout == ""
    for name in names:
        assert str(name) in lines[0], (name, lines[0])


FLAG_ERRORS = {
    "negative temperature": (["--temperature", "-1"], ["--temperature", ">= 0"]),
    "infinite temperature": (["--temperature", "inf"], ["--temperature", "finite"]),
    "top-p 0": (["--top-p", "0"], ["--top-p", "(0, 1]"]),
    "top-p 2": (["--top-p", "2"], ["--top-p", "(0, 1]"]),
    "no layers": (["--layers", "0"], ["--layers", ">= 1"]),
    "unknown backend": (["--implementation", "fast"], ["--implementation", "fast"]),
    "heads do not divide": (["--hidden", "30", "--heads", "4"], ["--hidden 30", "--heads 4"]),
    "odd head dim": (["--hidden", "30"], ["--hidden 30", "--heads 2", "even"]),
    "kv heads do not divide": (["--heads", "2", "--kv-heads", "3"], ["--heads 2", "--kv-heads 3"]),
    "devices do not divide": (["--devices", "3"], ["--devices 3", "--heads"]),
    "no requests": (["--chats", "0", "--few-shot", "0"], ["--chats", "--few-shot"]),
    "pool too small": (["--num-pages", "11"], ["--num-pages 11", "at least 12"]),
    "unknown kv dtype": (["--kv-dtype", "int8"], ["--kv-dtype", "int8"]),
    "kv dtype of the model": (["--kv-dtype", "float32"], ["--kv-dtype", "float32"]),
    "beyond max positions": (
        ["--system-tokens", "5000"],
        ["max_position_embeddings=4096", "--system-tokens"],
    ),
}


@pytest.mark.parametrize("case", sorted(FLAG_ERRORS))
def test_flag_errors(case):
    args, names = FLAG_ERRORS[case]
    assert_usage_error(run_cli("demo", *TINY, *args), *names)


def test_backend_not_available_here(monkeypatch, capsys):
    import jaxattn

    monkeypatch.setattr(jaxattn, "available_backends", lambda op="paged_attention": ("reference",))
    assert main(["demo", *TINY, "--implementation", "native"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "--implementation native: not available" in err[0]


def test_unknown_command():
    assert_usage_error(run_cli("serve"), "serve", "demo", "info")


# --- checkpoints ---------------------------------------------------------------------------

HF = dict(
    model_type="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    torch_dtype="float32",
)


def hf_weights(rng) -> dict[str, np.ndarray]:
    h, i, v, d = 32, 64, 64, 16
    w = lambda *shape: rng.standard_normal(shape).astype(np.float32) / np.sqrt(shape[-1])
    p = "model.layers.0."
    return {
        "model.embed_tokens.weight": w(v, h),
        "model.norm.weight": np.ones(h, np.float32),
        "lm_head.weight": w(v, h),
        p + "input_layernorm.weight": np.ones(h, np.float32),
        p + "post_attention_layernorm.weight": np.ones(h, np.float32),
        p + "self_attn.q_proj.weight": w(2 * d, h),
        p + "self_attn.k_proj.weight": w(d, h),
        p + "self_attn.v_proj.weight": w(d, h),
        p + "self_attn.o_proj.weight": w(h, 2 * d),
        p + "mlp.gate_proj.weight": w(i, h),
        p + "mlp.up_proj.weight": w(i, h),
        p + "mlp.down_proj.weight": w(h, i),
    }


@pytest.fixture
def checkpoint(tmp_path, rng):
    """A valid tiny Llama directory; tests break one file of it."""
    (tmp_path / "config.json").write_text(json.dumps(HF))
    save_file(hf_weights(rng), str(tmp_path / "model.safetensors"))
    return tmp_path


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


BREAKS = {
    "no directory": (lambda d: shutil.rmtree(d), ["--checkpoint", "no such directory"]),
    "no config": (lambda d: (d / "config.json").unlink(), ["config.json", "not found"]),
    "corrupt config": (
        lambda d: (d / "config.json").write_text('{"vocab_size": 64 "hidden_size": 32}'),
        ["config.json", "not valid JSON", "line 1"],
    ),
    "config is a list": (
        lambda d: (d / "config.json").write_text(json.dumps([HF])),
        ["config.json", "JSON object", "an array"],
    ),
    "config value": (
        lambda d: (d / "config.json").write_text(json.dumps(dict(HF, vocab_size=-1))),
        ["config.json", "vocab_size"],
    ),
    "no weights": (lambda d: (d / "model.safetensors").unlink(), ["no *.safetensors"]),
    "empty weights": (
        lambda d: (d / "model.safetensors").write_bytes(b""),
        ["model.safetensors", "not a readable safetensors file"],
    ),
    "truncated weights": (
        lambda d: _truncate(d / "model.safetensors"),
        ["model.safetensors", "not a readable safetensors file"],
    ),
}


@pytest.mark.parametrize("case", sorted(BREAKS))
def test_checkpoint_errors_name_the_file(checkpoint, case):
    breaks, names = BREAKS[case]
    breaks(checkpoint)
    assert_usage_error(run_cli("demo", "--checkpoint", str(checkpoint), *TINY), *names)


def test_checkpoint_that_lacks_a_tensor(checkpoint, rng, capsys):
    weights = hf_weights(rng)
    del weights["model.norm.weight"]
    save_file(weights, str(checkpoint / "model.safetensors"))
    assert main(["demo", "--checkpoint", str(checkpoint), *TINY]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "--checkpoint" in err[0] and "model.norm.weight" in err[0]


def test_checkpoint_with_a_nan_fails_instead_of_serving(checkpoint, rng, capsys):
    """One NaN in the embedding table: the requests that read it end with an error, and the
    demo says so on one line with status 1, instead of printing plausible tokens."""
    weights = hf_weights(rng)
    weights["model.embed_tokens.weight"][:, 3] = np.nan
    save_file(weights, str(checkpoint / "model.safetensors"))
    assert main(["demo", "--checkpoint", str(checkpoint), *TINY]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and "not finite" in err[0], err


# --- interrupts ----------------------------------------------------------------------------


def test_ctrl_c_is_one_line_and_status_130():
    # A run long enough to still be serving when the signal lands. The child turns SIGINT
    # back into KeyboardInterrupt first: a runner that starts the tests in the background
    # ignores SIGINT, and an ignored signal stays ignored in the children.
    args = "--layers 1 --hidden 32 --heads 2 --kv-heads 1 --vocab 64 --chats 8 --turns 4"
    args += " --few-shot 8 --max-new-tokens 400 --quiet"
    start = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        f"sys.argv = ['jaxattn', 'demo', *{args.split()!r}]; "
        "runpy.run_module('jaxattn', run_name='__main__', alter_sys=True)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", start],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        header = proc.stderr.readline()  # printed once the engine is built
        assert header.startswith("jaxattn demo on"), header
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.splitlines() == ["python -m jaxattn demo: interrupted"]
    assert out == ""


def test_ctrl_c_inside_a_finalizer_is_sent_again_and_ends_with_130(monkeypatch, capsys):
    # Python prints and drops a KeyboardInterrupt raised inside a __del__ or a garbage
    # collector callback (the failure seen when Ctrl-C landed in JAX's gc callback: the run
    # went on to the end and exited with 0). The CLI does not raise there; it sends the signal
    # again, and the run ends as interrupted, with one line and no traceback.
    import jaxattn.__main__ as cli

    class InterruptsWhileCollected:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the handler runs here, inside __del__
                pass

    def run_that_collects(args):
        InterruptsWhileCollected()
        time.sleep(5)  # the signal sent again interrupts this
        return 0

    monkeypatch.setattr(cli, "_run", run_that_collects)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        start = time.perf_counter()
        assert main(["info"]) == 130
        assert time.perf_counter() - start < 4
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
    assert capsys.readouterr().err.splitlines() == ["python -m jaxattn info: interrupted"]


def test_ctrl_c_lost_on_its_way_up_still_ends_with_130(monkeypatch, capsys):
    # An interrupt noted but never raised to the top (here: the command returns before the
    # signal sent again arrives) still ends the run as interrupted.
    import jaxattn.__main__ as cli

    class InterruptsWhileCollected:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass

    def run_that_returns_at_once(args):
        InterruptsWhileCollected()
        return 0

    monkeypatch.setattr(cli, "_run", run_that_returns_at_once)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert main(["info"]) == 130
        time.sleep(0.1)  # a signal sent again after the command would surface here
    finally:
        signal.signal(signal.SIGINT, previous)
    assert capsys.readouterr().err.splitlines() == ["python -m jaxattn info: interrupted"]


# --- the demo's checks match the engine's ----------------------------------------------


def test_pool_check_admits_a_pool_that_just_fits(capsys):
    # The longest request of TINY's workload: the second chat turn, 48 tokens of KV.
    workload = make_workload(64, system_tokens=16, chats=1, turns=2, few_shot=1, example_tokens=8)
    assert workload.longest_request(4) == 49
    assert main(["demo", *TINY, "--num-pages", "12", "--verify"]) == 0
    assert "verify (no-cache recompute)   OK" in capsys.readouterr().out
    assert main(["demo", *TINY, "--num-pages", "11"]) == 2
    assert "--num-pages 11" in capsys.readouterr().err


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_demo_serves_from_an_fp8_pool_and_verifies(kv_dtype, capsys):
    assert main(["demo", *TINY, "--kv-dtype", kv_dtype, "--verify", "--json"]) == 0
    out = capsys.readouterr().out
    assert "verify (no-cache recompute)   OK" in out
    name = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}[kv_dtype]
    # TINY: one KV head of 16 dims, one layer, 256 pages of 4 tokens: one byte each.
    assert f"KV cache dtype                {name} ({kv_dtype}: scales per layer" in out
    stats = json.loads(out[out.index("{") :])
    assert stats["kv_pool_bytes"] == 2 * 1 * 256 * 4 * 16
    assert stats["kv_dtype"] == name


def test_engine_refuses_a_request_beyond_max_position_embeddings():
    cfg = llama.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=40,
    )
    engine = Engine(cfg, None, runner=object(), num_pages=64, page_size=4)
    with pytest.raises(ValueError, match=r"prompts\[0\] \(41 tokens\).*max_position_embeddings=40"):
        engine.generate([[1] * 41], 1)
    with pytest.raises(ValueError, match=r"needs 45 positions.*max_position_embeddings=40"):
        engine.add_request([1] * 30, 15)
    assert not engine.has_work()


# --- info -------------------------------------------------------------------------------


def test_info_runs_without_a_gpu_or_a_build_record():
    result = run_cli("info")
    assert result.returncode == 0, result.stderr
    for word in ("jaxattn", "jax ", "default backend", "implementation=None", "pallas", "cpu"):
        assert word in result.stdout
    env = json.loads(run_cli("info", "--json").stdout)
    assert env["backend"] == jax.default_backend()
    assert env["default_implementations"][-1] == "reference"
    assert set(env["native"]) == {"cpu", "cuda", "rocm"}
    if os.environ.get("JAXATTN_REQUIRE_NATIVE"):
        # Built by this checkout's pip install, which writes the build record.
        cpu = env["native"]["cpu"]
        assert cpu["loads"] is True and cpu["build"]["file"] == "libjaxattn_cpu.so"


def test_info_reads_the_build_record(tmp_path, monkeypatch, capsys):
    found = native.library_path("cpu")
    if found is None:
        pytest.skip("no native CPU library built")
    shutil.copy(found, tmp_path / "libjaxattn_cpu.so")
    monkeypatch.setenv("JAXATTN_NATIVE_LIB_DIR", str(tmp_path))

    class Args:
        json = False

    info(Args())
    out = capsys.readouterr().out
    assert f"{tmp_path}/libjaxattn_cpu.so" in out
    assert "compiler and architectures unknown" in out and "why: unknown" in out

    record = {
        "libraries": {
            "cpu": {"file": "libjaxattn_cpu.so", "compiler": "GNU 12.2.0", "architectures": ["x86"]}
        },
        "not_built": {"cuda": "JAXATTN_CUDA=AUTO: nvcc found but no NVIDIA GPU", "rocm": "off"},
    }
    (tmp_path / native.BUILD_INFO).write_text(json.dumps(record))
    libs = native.library_info()
    assert libs["cpu"]["loads"] is True and libs["cpu"]["build"] == record["libraries"]["cpu"]
    assert libs["cuda"]["path"] is None and libs["cuda"]["not_built"].startswith("JAXATTN_CUDA")
    info(Args())
    out = capsys.readouterr().out
    assert "GNU 12.2.0, for x86" in out and "not built: JAXATTN_CUDA=AUTO" in out


def test_cuda_fit_of_a_device():
    archs = ["sm_80", "sm_90"]
    assert _cuda_fit("9.0", archs) == "" and _cuda_fit("8.6", archs) == ""
    assert "PTX" in _cuda_fit("10.0", archs)
    assert "JAXATTN_CUDA_ARCHS=75" in _cuda_fit("7.5", archs)
