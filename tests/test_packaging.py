"""The build's decisions, from CMake configure runs alone (seconds, no compiling): which
native libraries an install builds with and without a visible GPU, what it says about each,
and the build record it writes; the compile timer; the packaging settings."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMER = ROOT / "ffi" / "cmake" / "timed.py"
cmake = pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
NVCC = shutil.which("nvcc")
# A real NVIDIA GPU or driver here would make AUTO build the CUDA library: the tests that
# expect it skipped then cannot run.
REAL_NVIDIA = os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None
NINJA = shutil.which("ninja")


def configure(build: pathlib.Path, *defines, path_prefix=None, env=None):
    """Configure the project into ``build``; (exit status, output, build record or None)."""
    environ = dict(os.environ, **(env or {}))
    for name in ("JAXATTN_CUDA", "JAXATTN_HIP", "JAXATTN_CUDA_ARCHS", "JAXATTN_HIP_ARCHS"):
        environ.pop(name, None)
    if path_prefix:
        environ["PATH"] = f"{path_prefix}{os.pathsep}{environ['PATH']}"
    result = subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(build), f"-DPython_EXECUTABLE={sys.executable}"]
        + (["-G", "Ninja"] if NINJA else [])
        + [f"-D{d}" for d in defines],
        capture_output=True,
        text=True,
        env=environ,
        timeout=300,
    )
    record = build / "ffi" / "_build_info.json"
    info = json.loads(record.read_text()) if record.exists() else None
    return result.returncode, result.stdout + result.stderr, info


def fake_nvidia_smi(directory: pathlib.Path, capability: str) -> pathlib.Path:
    """An nvidia-smi that reports one GPU of ``capability``: the GPU AUTO looks for."""
    directory.mkdir()
    tool = directory / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\necho {capability}\n")
    tool.chmod(0o755)
    return directory


@cmake
@pytest.mark.skipif(REAL_NVIDIA, reason="an NVIDIA GPU is visible here")
def test_auto_builds_the_cpu_library_alone_without_a_gpu(tmp_path):
    rc, out, info = configure(tmp_path / "b", "JAXATTN_HIP=OFF")
    assert rc == 0, out
    assert "jaxattn: building libjaxattn_cpu.so" in out
    assert "jaxattn: skipping libjaxattn_cuda.so: " in out
    why = info["not_built"]["cuda"]
    if NVCC:
        assert "nvcc found but no NVIDIA GPU or driver visible" in why and "JAXATTN_CUDA=ON" in why
    else:
        assert "nvcc not found" in why
    assert info["libraries"]["cpu"]["file"] == "libjaxattn_cpu.so"
    assert info["libraries"]["cpu"]["compiler"] and info["libraries"]["cpu"]["architectures"]
    assert set(info["libraries"]) == {"cpu"}
    assert info["not_built"]["rocm"] == "JAXATTN_HIP=OFF"
    # The CUDA language is never enabled: no test compile of nvcc on such a machine.
    assert "CUDA compiler identification" not in out


@cmake
@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
def test_auto_builds_the_cuda_library_for_the_visible_gpu(tmp_path):
    tools = fake_nvidia_smi(tmp_path / "bin", "9.0")
    rc, out, info = configure(tmp_path / "b", "JAXATTN_HIP=OFF", path_prefix=tools)
    assert rc == 0, out
    assert "jaxattn: building libjaxattn_cuda.so for sm_90 (JAXATTN_CUDA=AUTO: nvcc found" in out
    assert "architectures of the visible GPUs" in out and "Hopper kernels for sm_90a" in out
    cuda = info["libraries"]["cuda"]
    assert cuda["architectures"] == ["sm_90"] and cuda["hopper_prefill"] == "sm_90a"
    assert cuda["compiler"].startswith("NVIDIA ")
    if NINJA:
        # Every compile goes through the timer, the Hopper object's too.
        commands = subprocess.run(
            [NINJA, "-C", str(tmp_path / "b"), "-t", "commands"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        nvcc = [c for c in commands if " -c " in c and ".cu" in c]
        # Every GPU source of ffi/src (the Hopper kernels' included) is compiled.
        sources = len(list((ROOT / "ffi" / "src").glob("*.cu")))
        assert len(nvcc) == sources and all(str(TIMER) in c.split("nvcc")[0] for c in nvcc)
        # The Hopper objects (the prefill's one-tile and persistent launches, cascade decode's
        # wgmma prefix level) are built for sm_90a alone.
        hopper = len(list((ROOT / "ffi" / "src").glob("*_sm90*.cu")))
        assert hopper == 3 and sum('--what "nvcc sm_90a"' in c for c in nvcc) == hopper


@cmake
def test_switch_values(tmp_path):
    rc, out, _ = configure(tmp_path / "a", "JAXATTN_CUDA=maybe")
    assert rc != 0 and "JAXATTN_CUDA must be AUTO, ON or OFF, got 'maybe'" in out
    rc, out, info = configure(tmp_path / "b", "JAXATTN_CUDA=off", "JAXATTN_HIP=0")
    assert rc == 0, out
    assert info["not_built"] == {"cuda": "JAXATTN_CUDA=OFF", "rocm": "JAXATTN_HIP=OFF"}
    # ON without the compiler is an error that says where it was looked for.
    rc, out, _ = configure(
        tmp_path / "c",
        "JAXATTN_CUDA=ON",
        "JAXATTN_HIP=OFF",
        env={"CUDACXX": str(tmp_path / "no" / "nvcc"), "PATH": "/usr/bin:/bin"},
    )
    assert rc != 0 and "JAXATTN_CUDA=ON but nvcc was not found" in out


def test_timer_reports_each_compile_and_the_library(tmp_path):
    log = tmp_path / "times"
    compile_ok = [sys.executable, "-c", "pass", "-c", "src/paged_decode.cu"]
    run = lambda *args: subprocess.run(
        [sys.executable, str(TIMER), *args], capture_output=True, text=True, timeout=60
    )
    out = run("--log", str(log), "--what", "nvcc sm_90", "--", *compile_ok)
    assert out.returncode == 0
    assert out.stdout.startswith("jaxattn: paged_decode.cu (nvcc sm_90) ")
    failing = [sys.executable, "-c", "raise SystemExit(3)", "-c", "prefill.cu"]
    out = run("--log", str(log), "--what", "nvcc sm_90", "--", *failing)
    assert out.returncode == 3 and "FAILED (exit 3)" in out.stdout
    assert sorted(p.name for p in log.iterdir()) == ["paged_decode.cu.seconds"]
    out = run("--summary", str(log), "--what", "libjaxattn_cuda.so")
    assert out.stdout.startswith("jaxattn: libjaxattn_cuda.so ready: paged_decode.cu compiled")


def test_packaging_settings():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    skbuild = config["tool"]["scikit-build"]
    # The libraries are loaded with ctypes: one wheel per platform serves every Python 3.
    assert skbuild["wheel"]["py-api"] == "py3"
    defines = skbuild["cmake"]["define"]
    assert defines["JAXATTN_CUDA"] == {"env": "JAXATTN_CUDA", "default": "AUTO"}
    assert defines["JAXATTN_HIP"] == {"env": "JAXATTN_HIP", "default": "AUTO"}
