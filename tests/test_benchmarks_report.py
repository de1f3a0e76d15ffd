"""benchmarks/report.py on synthetic result files: exact markdown, no benchmark is run."""

from __future__ import annotations

import json

from benchmarks.report import EXPECTED, build_report, load_results

MACHINE = {"cpu": "Test CPU", "cores": 2, "memory_gib": 8.0, "platform": "Linux-test", "python": "3.11.7",
           "torch": "2.13.0", "git": "abc1234"}


def write(folder, name: str, data: dict) -> None:
    (folder / f"{name}.json").write_text(json.dumps(data))


def test_checks_targets_causes_and_missing_results(tmp_path):
    # An old-format file (a platform string for the machine, no date) and a new one with checks and notes.
    write(tmp_path, "tokenize", {
        "machine": "x86_64", "text_mb": 2.0, "paths": "a/*.txt", "actors": 2, "threads_per_actor": 1,
        "plain_threads": 2, "repeats": 3,
        "mb_per_s": {"plain_sentencepiece": {"median": 8.0, "min": 7.5, "max": 8.5},
                     "tokenize_stage": {"median": 4.0, "min": 3.5, "max": 4.5}},
        "ratio_tokenize_to_plain": {"median": 0.5, "min": 0.45, "max": 0.55, "values": [0.45, 0.5, 0.55]},
    })
    write(tmp_path, "zeta", {
        "machine": MACHINE, "written_at": "2026-01-02 03:04:05",
        "checks": [
            {"name": "A / B", "measured": {"median": 1.2, "min": 1.1, "max": 1.3}, "target": 1.15, "op": ">="},
            {"name": "C share", "measured": 0.08, "target": 0.05, "op": "<", "format": "percent"},
            {"name": "D / E", "measured": {"median": 0.9, "min": 0.8, "max": 1.1}, "target": 1.0, "op": ">="},
            {"name": "F / G", "measured": 0.7, "target": None, "op": ">="},
        ],
        "notes": {"C share": "the router is slow."},
    })
    write(tmp_path, "by_hand_notes", {"rows": [{"what": "a wall time", "figure": "about a minute"}]})
    results = load_results(tmp_path)
    # Expected ones first, then the others by name, the figures recorded by hand last.
    assert list(results) == ["tokenize", "zeta", "by_hand_notes"]
    lines = build_report(results).splitlines()

    # The page names no one machine for all: each section names its own, its commit and its date.
    assert not any(line.startswith("Machine:") for line in lines[:lines.index("## Targets")])
    summary = lines[lines.index("## Targets") + 2:]
    assert summary[:7] == [
        "| benchmark | check | median | target | status |",
        "|---|---|---|---|---|",
        "| tokenize | tokenize stage / plain sentencepiece MB/s | 0.50 | >= 0.80 | BELOW |",
        "| zeta | A / B | 1.20 | >= 1.15 | PASS |",
        "| zeta | C share | 8.0% | < 5.0% | BELOW |",
        "| zeta | D / E | 0.90 | >= 1.00 | BELOW |",
        "| zeta | F / G | 0.70 | - | no target |",
    ]
    for name in ("peak", "train_throughput", "moe", "pipeline"):
        assert f"- `{name}`: not run (no `benchmarks/results/{name}.json`; run {EXPECTED[name]})." in lines
    assert "- `tokenize`: not run" not in "\n".join(lines)

    assert lines[lines.index("## tokenize") + 2] == (
        "Machine: not recorded (only the platform string x86_64). Commit: not recorded. Written: not recorded. "
        "(`benchmarks/results/tokenize.json`.)")
    assert "| tokenize_stage | 4.00 | 3.50-4.50 |" in lines
    assert ("- BELOW: tokenize stage / plain sentencepiece MB/s. Cause: Not yet known (no note in the result "
            "file, none recorded in report.py).") in lines
    assert lines[lines.index("## zeta") + 2] == (
        "Machine: Test CPU, 2 cores, 8.0 GiB. Commit: abc1234. Written: 2026-01-02 03:04:05. "
        "(`benchmarks/results/zeta.json`; Linux-test; python 3.11.7, torch 2.13.0.)")
    # A file without a machine or a commit says so rather than borrowing another's.
    assert lines[lines.index("## by_hand_notes") + 2:lines.index("## by_hand_notes") + 7] == [
        "Machine: not recorded. Commit: not recorded. Written: not recorded. "
        "(`benchmarks/results/by_hand_notes.json`.)",
        "",
        "| what | figure |",
        "|---|---|",
        "| a wall time | about a minute |",
    ]
    assert "| C share | 8.0% | - | < 5.0% | BELOW |" in lines
    assert "- BELOW: C share. Cause: the router is slow." in lines
    assert ("- BELOW: D / E. Cause: The target lies inside the measured range, so repeat-to-repeat noise on this "
            "machine is as large as the gap; rerun on a quiet machine before reading more into it.") in lines
    assert not any(line.startswith("- BELOW: A / B") or line.startswith("- BELOW: F / G") for line in lines)


def test_old_train_throughput_format_and_a_machine_of_two_sections(tmp_path):
    row = {"preset": "p", "tokens_per_s": 1000.0, "mfu": 0.3, "threads": 2}
    write(tmp_path, "train_throughput", {"machine": "Linux-x", "peak_fp32_flops": 3.0e11, "rows": [
        {**row, "impl": "conduit", "min": 900.0, "max": 1100.0, "ratio_vs_hf": 1.25},
        {**row, "impl": "hf_llama", "tokens_per_s": 800.0, "min": 750.0, "max": 900.0, "ratio_vs_hf": 1.0},
    ]})
    write(tmp_path, "other", {"machine": {"cpu": "Other CPU", "cores": 4, "git": "def5678"},
                              "written_at": "2026-02-03 04:05:06", "rows": [{"a": 1}]})
    text = build_report(load_results(tmp_path))
    section = text[text.index("## train_throughput"):]
    # Each section is headed by its own machine; a platform string is not taken for a CPU.
    assert section.splitlines()[2] == ("Machine: not recorded (only the platform string Linux-x). Commit: not "
                                       "recorded. Written: not recorded. (`benchmarks/results/train_throughput.json`.)")
    assert ("Machine: Other CPU, 4 cores. Commit: def5678. Written: 2026-02-03 04:05:06. "
            "(`benchmarks/results/other.json`.)") in text.splitlines()
    section = section[:section.index("## other")].rstrip("\n") + "\n"
    assert section.splitlines()[4:] == [
        "fp32 matmul peak (MFU denominator): 300 GFLOP/s",
        "",
        "| preset | tokens_per_s | mfu | threads | impl | min | max | ratio_vs_hf |",
        "|---|---|---|---|---|---|---|---|",
        "| p | 1,000 | 30.0% | 2 | conduit | 900 | 1,100 | 1.25 |",
        "| p | 800 | 30.0% | 2 | hf_llama | 750 | 900 | 1.00 |",
        "",
        "Checks (targets from the issues; none: reported only):",
        "",
        "| check | median | range | target | status |",
        "|---|---|---|---|---|",
        # The ratio's range from each side's range: 900 / 900 to 1100 / 750.
        "| p: our model / HF Llama tokens/s (bare loop) | 1.25 | 1.00-1.47 | >= 1.00 | PASS |",
    ]


def test_ratios_with_goals_and_summary_cells(tmp_path):
    # A format carrying ``ratios`` with goals and rows whose values are summaries (unknown name: generic).
    write(tmp_path, "custom", {"machine": MACHINE, "rows": [
        {"impl": "a", "tokens_per_s": {"median": 1500.0, "min": 1400.0, "max": 1600.0, "values": [1]}, "mfu": 0.25},
    ], "ratios": {"a/b": {"median": 0.9, "min": 0.95, "max": 0.97, "goal": 1.0}, "c/d": {"median": 2.0}}})
    lines = build_report(load_results(tmp_path)).splitlines()
    section = lines[lines.index("## custom") + 4:]
    assert section == [
        "| impl | tokens_per_s | mfu |",
        "|---|---|---|",
        "| a | 1,500 (1,400-1,600) | 25.0% |",
        "",
        "Checks (targets from the issues; none: reported only):",
        "",
        "| check | median | range | target | status |",
        "|---|---|---|---|---|",
        "| a/b | 0.90 | 0.95-0.97 | >= 1.00 | BELOW |",
        "| c/d | 2.00 | - | - | no target |",
        "",
        "- BELOW: a/b. Cause: Not yet known (no note in the result file, none recorded in report.py).",
    ]


def test_a_summary_is_printed_under_its_table(tmp_path):
    write(tmp_path, "told", {"machine": MACHINE, "rows": [{"method": "yarn", "bpb_64": "2.0192"}],
                             "summary": "YaRN keeps the high frequencies.", "checks": []})
    lines = build_report(load_results(tmp_path)).splitlines()
    section = lines[lines.index("## told") + 4:]
    assert section[:5] == ["| method | bpb_64 |", "|---|---|", "| yarn | 2.0192 |", "", "YaRN keeps the high frequencies."]
