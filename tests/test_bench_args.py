"""bench/args.py: the configuration a parsed command line fills, and errors reported as one line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from cacheblend_bench.args import config, csv, ints, run_reporting


@dataclass
class _Cfg:
    model: str = "smollm2"
    n: int = 30
    out_dir: str = "x"
    progress: bool = True
    dataset: str = "musique"
    seed: int = 0  # no --seed below: keeps its default


def test_config_takes_options_by_name_renamed_ones_and_keeps_defaults_for_the_rest():
    args = argparse.Namespace(model="qwen2.5-coder-0.5b", n=5, out="runs/a", quiet=True, datasets=("hotpotqa", "musique"))
    cfg = config(_Cfg, args, n=7)
    assert cfg == _Cfg(model="qwen2.5-coder-0.5b", n=7, out_dir="runs/a", progress=False, dataset="hotpotqa", seed=0)


def test_list_options_and_errors_as_one_line(capsys):
    assert csv(" a, b,,c ") == ("a", "b", "c") and ints("1,2") == (1, 2)

    def bad() -> int:
        raise ValueError("--lengths 0: give answer lengths of at least 1 token")

    assert run_reporting(bad) == 2
    assert capsys.readouterr().err == "error: --lengths 0: give answer lengths of at least 1 token\n"
    assert run_reporting(lambda: 0) == 0
