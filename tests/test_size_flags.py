"""Every size flag of the CLI reads sizes one way (clef_local/units.py: KiB..TiB binary, KB..TB decimal, a bare
number is bytes) and refuses the rest, naming the value and the forms. Before: ``--device 24GB`` meant GiB while
``--max-memory 24GB`` meant 10^9 bytes, and ``--state-cache 2G`` was accepted where ``--max-memory 2G`` was refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clef_local.cli import main
from clef_local.units import FORMS, GiB

# (command line with {size} where the size goes, what the error calls it); the models are never loaded: the size is
# read first ({model}: a tiny release, {tmp}: a fresh directory)
FLAGS = [
    ("plan --config clef --device {size}", "the device size"),
    ("plan --config clef --max-memory {size}", "the memory size"),
    ("plan --config clef --max-memory cuda:0={size}", "the memory size"),
    ("plan --config clef --read-rate {size}", "the read rate"),
    ("decide --example triage --max-memory {size}", "the memory size"),
    ("quantize --bits 4 --model {model} --out {tmp}/q --max-memory {size}", "the memory size"),
    ("serve --model m=/nonexistent --state-cache {size}", "the state cache size"),
    ("mcp --model m=/nonexistent --remember {size}", "--remember"),
]


@pytest.mark.parametrize("bad", ["2G", "24 gigs", "1.5GiBs"])
@pytest.mark.parametrize(("line", "what"), FLAGS)
def test_every_size_flag_refuses_what_it_cannot_read(line: str, what: str, bad: str, tiny_llama: Path,
                                                     tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    fill = {"{size}": bad, "{model}": str(tiny_llama), "{tmp}": str(tmp_path)}
    argv = []
    for part in line.split():
        for key, value in fill.items():
            part = part.replace(key, value)
        argv.append(part)
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's type= errors (serve, mcp)
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    assert f"cannot read {what} {bad!r}: give {FORMS}" in err, err
    assert not (tmp_path / "q").exists()


def plan(*flags: str, capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(["plan", "--config", "clef", "--json", *flags]) in (0, 1)  # 1: nothing fits, still a plan
    return json.loads(capsys.readouterr().out)["hardware"]


@pytest.mark.parametrize(("size", "nbytes"), [("24GB", 24 * 10**9), ("24GiB", 24 * GiB), ("24000MiB", 24000 << 20)])
def test_device_and_max_memory_read_a_size_as_the_same_bytes(size: str, nbytes: int,
                                                              capsys: pytest.CaptureFixture[str]):
    assert plan("--device", size, capsys=capsys)["total_bytes"] == nbytes
    assert plan("--device", "h200", "--max-memory", size, capsys=capsys)["cap_bytes"] == nbytes
    assert plan("--device", "h200", "--max-memory", f"cuda:0={size}", capsys=capsys)["cap_bytes"] == nbytes
