"""ffi/tests_gpu/decode_trace.py: the decode self-test's block timelines, read (no GPU)."""

import importlib.util
import pathlib

_PATH = pathlib.Path(__file__).resolve().parents[1] / "ffi" / "tests_gpu" / "decode_trace.py"
_spec = importlib.util.spec_from_file_location("decode_trace", _PATH)
decode_trace = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(decode_trace)


def _write(path, blocks):
    """blocks: (sm, start_us, end_us) each; tiles 0..7 spread evenly over the block."""
    lines = ["block,sm," + ",".join(f"s{i}" for i in range(14))]
    for b, (sm, t0, t1) in enumerate(blocks):
        s = [-1] * 14
        s[0], s[2], s[12], s[13] = t0, t0, t1, t1
        for n in range(8):
            s[4 + n] = t0 + (t1 - t0) * n / 8
        lines.append(f"{b},{sm}," + ",".join(str(int(v * 1000)) if v >= 0 else "-1" for v in s))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_an_unbalanced_grid_is_twice_its_balanced_estimate(tmp_path, capsys):
    # SM 0 runs a block in 50 us, SM 1 in 100 us; SM 1 got two blocks, SM 0 one: the span is
    # 200 us, while the three blocks spread by speed (two to SM 0) end at 100 us.
    path = _write(tmp_path / "t.csv", [(0, 0, 50), (1, 0, 100), (1, 100, 200)])
    decode_trace.report(path)
    out = capsys.readouterr().out
    assert "3 blocks on 2 SMs, span 200.0 us" in out
    assert "blocks an SM (blocks: SMs): {1: 1, 2: 1}" in out
    assert "balanced estimate (1 slots an SM, each SM at its own rate): 100.0 us" in out
    assert "the span 100.0% over it" in out


def test_a_balanced_grid_is_its_own_estimate(tmp_path, capsys):
    path = _write(tmp_path / "t.csv", [(0, 0, 50), (0, 50, 100), (1, 0, 100)])
    decode_trace.report(path)
    assert "100.0 us, the span 0.0% over it" in capsys.readouterr().out


def test_sm_speeds_compare_across_traces(tmp_path, capsys):
    fast_first = [(sm, 0, 10 * (sm + 1)) for sm in range(12)]
    a = _write(tmp_path / "a.csv", fast_first)
    b = _write(tmp_path / "b.csv", [(sm, 0, 2 * t1) for sm, _, t1 in fast_first])
    c = _write(tmp_path / "c.csv", [(sm, 0, 10 * (12 - sm)) for sm in range(12)])
    decode_trace.compare(a, b)
    out = capsys.readouterr().out
    assert "correlation 1.00" in out
    assert "fastest 2 SMs of the first: [0, 1]" in out
    assert "their ranks in the second: [0, 1]" in out
    decode_trace.compare(a, c)
    assert "correlation -1.00" in capsys.readouterr().out


def _blocks_with_tiles(path, blocks, tiles):
    """As _write, but stamps 4 and 12 bracket `tiles` key tiles: start -> tile 0 takes 1 us,
    the loop (t1 - t0 - 2) us, the writes 1 us."""
    lines = ["block,sm," + ",".join(f"s{i}" for i in range(14))]
    for b, (sm, t0, t1) in enumerate(blocks):
        s = [-1] * 14
        s[0], s[2], s[4], s[12], s[13] = t0, t0, t0 + 1, t1 - 1, t1
        for n in range(1, 8):
            s[4 + n] = t0 + 1 + (t1 - t0 - 2) * n / tiles
        lines.append(f"{b},{sm}," + ",".join(str(int(v * 1000)) if v >= 0 else "-1" for v in s))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_the_model_of_a_grid_reproduces_its_span(tmp_path):
    # One slot an SM; SM 0 runs 8 tiles in 8 us, SM 1 in 16 us; four blocks in two waves.
    blocks = [(0, 0, 10), (1, 0, 18), (0, 10, 20), (1, 18, 36)]
    path = _blocks_with_tiles(tmp_path / "t.csv", blocks, 8)
    assert abs(decode_trace.simulate(path, 8) - 36.0) < 1e-6


def test_free_stealing_balances_and_costly_stealing_does_not(tmp_path):
    # Two SMs, one twice as fast, one block each over 16 tiles: alone, the slow one ends at 34.
    blocks = [(0, 0, 18), (1, 0, 34)]
    path = _blocks_with_tiles(tmp_path / "t.csv", blocks, 16)
    own = decode_trace.simulate(path, 16)
    assert abs(own - 34.0) < 1e-6
    free = decode_trace.simulate(path, 16, "steal", 1, 0.0, probe_us=0.0, restart_us=0.0)
    assert free < own - 5  # the fast SM takes a share of the slow one's tiles
    costly = decode_trace.simulate(path, 16, "steal", 1, 5.0, probe_us=1.0, restart_us=20.0)
    assert costly > own
    claim = decode_trace.simulate(path, 16, "claim", 1, 0.0, probe_us=0.0, restart_us=0.0)
    assert claim < own - 5


def test_a_static_split_by_the_sms_own_speeds_balances(tmp_path):
    # SM 0 runs 16 tiles in 16 us, SM 1 in 32 us (one block each, 1 us start and finish).
    path = _blocks_with_tiles(tmp_path / "t.csv", [(0, 0, 18), (1, 0, 34)], 16)
    equal = decode_trace.static_split(path, 16, None, combine_us=0.0)
    assert abs(equal - 34.0) < 1e-6  # 16 tiles each: the slow SM bounds it
    own = decode_trace.static_split(path, 16, path, combine_us=0.0)
    assert abs(own - (2 + 32 * (2 / 3) * 1.0)) < 1e-6  # shares 2:1, both end together
    flipped = _blocks_with_tiles(tmp_path / "f.csv", [(0, 0, 34), (1, 0, 18)], 16)
    assert decode_trace.static_split(path, 16, flipped, combine_us=0.0) > equal
