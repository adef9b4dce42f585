"""Strategy comparison: `fedlora compare`, its summary and plots, resume, and the notebook."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import QUICK_CUT, QUICK_CUT_OPTIONS

from fedlora.app.compare import ComparisonTable, Job, is_complete, job_config, run_row, summarize
from fedlora.app.compare import compare as compare_strategies
from fedlora.app.plotting import COMPARISON_PLOTS
from fedlora.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs/smoke.toml"
NOTEBOOK = ROOT / "simulations/notebooks/compare_strategies.ipynb"
STRATEGIES = ("fedit", "flexlora")


def results_mtimes(out: Path) -> dict[str, int]:
    return {str(p.relative_to(out)): p.stat().st_mtime_ns for p in sorted(out.glob("*/seed*/results.json"))}


def fake_results(seed: int, weighted: float, unweighted: float, rounds: int = 2) -> dict:
    """A minimal results.json dict (the fields the summary reads)."""
    per_round = [
        {"round": r, "bytes_up": 100, "bytes_down": 200, "client_train_seconds": 1.5, "aggregation_seconds": 0.25}
        for r in range(1, rounds + 1)
    ]
    final = {
        "global_accuracy": 0.5, "personalized_accuracy": weighted, "personalized_accuracy_unweighted": unweighted,
        "personalized_accuracy_worst": 0.1, "personalized_accuracy_p10": 0.2, "best_round": 1,
        "best_global_accuracy": 0.4, "best_personalized_accuracy": 0.3,
    }
    return {"config": {"train": {"seed": seed}}, "rounds": per_round, "final": final, "wall_seconds": 10.0}


# --------------------------------------------------------------------------- summary semantics
def test_run_row_sums_costs_and_keeps_both_averages() -> None:
    # Execute
    row = run_row(fake_results(0, weighted=0.8, unweighted=0.6, rounds=2))
    # Assert: per-round bytes are means, totals and seconds are sums over rounds
    assert row["bytes_up_per_round"] == 100 and row["bytes_down_per_round"] == 200
    assert row["bytes_total"] == 600
    assert row["client_train_seconds"] == 3.0 and row["aggregation_seconds"] == 0.5
    assert (row["personalized_accuracy"], row["personalized_accuracy_unweighted"]) == (0.8, 0.6)
    assert row["best_round"] == 1 and row["best_personalized_accuracy"] == 0.3


def test_table_mean_std_over_seeds_and_legend_names_each_average() -> None:
    # Prepare: two seeds of one strategy, one seed of another
    runs = [
        {"strategy": "a", "seed": s, "path": f"seed{s}", **run_row(fake_results(s, w, 0.5))}
        for s, w in ((0, 0.6), (1, 0.8))
    ] + [{"strategy": "b", "seed": 0, "path": "seed0", **run_row(fake_results(0, 0.7, 0.4))}]
    # Execute
    table = ComparisonTable(runs, scale="test scale")
    markdown, csv_text, html = table.to_markdown(), table.to_csv(), table._repr_html_()
    # Assert
    assert table.strategies == ["a", "b"]
    assert math.isclose(table["a"]["personalized_accuracy_mean"], 0.7)
    assert math.isclose(table["a"]["personalized_accuracy_std"], math.sqrt(0.02))  # sample std of 0.6, 0.8
    compact = re.sub(r" +\|", " |", re.sub(r"\| +", "| ", markdown))  # pipe-table cells without padding
    assert "0.7000 ± 0.1414" in markdown and "| b | 1 | 0.5000 |" in compact  # one seed: no ± shown
    assert "pers. acc (weighted)" in markdown and "pers. acc (unweighted)" in markdown
    assert "weighted by the clients' test examples" in markdown and "plain mean over clients" in markdown
    assert "held-out global test set" in markdown and "never used for selection" in markdown
    assert csv_text.splitlines()[0].startswith("strategy,seeds,global_accuracy_mean,global_accuracy_std")
    assert "<table" in html and "</table>" in html and table._repr_markdown_() == markdown


def test_the_terminal_table_fits_100_columns_and_the_files_keep_every_column() -> None:
    # Prepare: the acceptance comparison's five strategies, three seeds each
    names = ("fedpissa", "fedhera", "feddr_lora", "fedtreelora", "fedit")
    runs = [{"strategy": name, "seed": seed, "path": f"seed{seed}",
             **run_row(fake_results(seed, 0.61 + 0.1 * seed + 0.01 * i, 0.5))}
            for i, name in enumerate(names) for seed in range(3)]
    table = ComparisonTable(runs, scale="model minilm, data wordnet/noun8 (max_examples 2000, dirichlet alpha 0.5, "
                                        "data.seed 0), 4 clients, 5 rounds, 1 local epoch(s) capped at 8 steps")
    # Execute
    text, markdown = table.to_text(), table.to_markdown()
    # Assert: within 100 columns, with the accuracies (mean ± std) and their legend; the wide form is wider
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "| global " in text and "| pers. (weighted) " in text and "0.7300 ± 0.1000" in text
    assert "pers. (weighted): final round: each client's own model" in text.replace("\n  ", " ")
    assert max(len(line) for line in markdown.splitlines()) > 100 and "wall s" in markdown
    assert "mean ± std over 3 seed(s)" in text
    # ... and a narrower terminal drops the lowest-priority columns first, never the accuracies
    narrow = table.to_text(width=70)
    assert max(len(line) for line in narrow.splitlines() if line.startswith("|")) <= 70
    assert "| global " in narrow and "wall s" not in narrow


# --------------------------------------------------------------------------- jobs
def test_jobs_share_partitions_and_differ_only_in_train_seed(tmp_path: Path) -> None:
    # Prepare
    base = load_config(SMOKE)
    jobs = [Job(strategy, seed) for strategy in STRATEGIES for seed in (0, 1)]
    # Execute
    configs = [job_config(base, job, job.run_dir(tmp_path)) for job in jobs]
    # Assert
    assert all(c.data == base.data for c in configs)
    assert [c.train.seed for c in configs] == [0, 1, 0, 1]
    assert [c.strategy.name for c in configs] == ["fedit", "fedit", "flexlora", "flexlora"]
    assert configs[3].output.dir == str(tmp_path / "flexlora" / "seed1")


@pytest.mark.parametrize(
    "job, message",
    [
        (Job("nope", 0), "unknown strategy 'nope'"),
        (Job("fedit", 0, ("train.rounds=0",)), "train.rounds"),
        (Job("fedit", 0, ("strategy.bogus=1",)), "strategy.bogus"),
    ],
)
def test_bad_job_is_a_config_error(tmp_path: Path, job: Job, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        job_config(load_config(SMOKE), job, tmp_path)


def test_partial_results_are_not_complete(tmp_path: Path) -> None:
    # Prepare: a run that stopped after round 1 of 2, and a finished one of another config
    config = job_config(load_config(SMOKE), Job("fedit", 0), tmp_path)
    partial = fake_results(0, 0.5, 0.5, rounds=1) | {"config": config.model_dump(mode="json")}
    (tmp_path / "results.json").write_text(json.dumps(partial))
    # Execute / Assert
    assert not is_complete(tmp_path, config)
    other = job_config(load_config(SMOKE, ["train.lr=0.5"]), Job("fedit", 0), tmp_path)
    (tmp_path / "results.json").write_text(json.dumps(fake_results(0, 0.5, 0.5) | {"config": other.model_dump(mode="json")}))
    assert not is_complete(tmp_path, config)
    (tmp_path / "results.json").write_text(json.dumps(fake_results(0, 0.5, 0.5) | {"config": config.model_dump(mode="json")}))
    assert is_complete(tmp_path, config)


def test_summary_leaves_out_runs_still_in_progress(tmp_path: Path) -> None:
    # Prepare: seed 0 finished (2 of 2 rounds), seed 1 still running (1 of 2)
    for seed, rounds in ((0, 2), (1, 1)):
        folder = tmp_path / "fedit" / f"seed{seed}"
        folder.mkdir(parents=True)
        results = fake_results(seed, 0.5 + seed, 0.5, rounds=rounds)
        results["config"]["train"]["rounds"] = 2
        (folder / "results.json").write_text(json.dumps(results))
    # Execute
    table = summarize(tmp_path, write=False)
    # Assert: one seed, the finished one
    assert table["fedit"]["seeds"] == 1 and table["fedit"]["personalized_accuracy_mean"] == 0.5


# --------------------------------------------------------------------------- end to end
def test_inprocess_compare_writes_summary_plots_and_resumes(tmp_path: Path) -> None:
    # Execute: 2 strategies x 2 seeds without Ray, two runs at a time in worker processes
    table = compare_strategies(SMOKE, STRATEGIES, seeds=(0, 1), out_dir=tmp_path, engine="inprocess", workers=2)
    first = results_mtimes(tmp_path)
    again = compare_strategies(SMOKE, STRATEGIES, seeds=(0, 1), out_dir=tmp_path, engine="inprocess")
    # Assert
    assert len(first) == 4 and results_mtimes(tmp_path) == first  # the rerun ran nothing
    assert table.strategies == list(STRATEGIES) and [r["seeds"] for r in table.rows] == [2, 2]
    for name in ("summary.csv", "summary.md", *COMPARISON_PLOTS):
        assert (tmp_path / name).stat().st_size > 0, name
    for row in table.rows:
        assert 0.0 <= row["personalized_accuracy_mean"] <= 1.0
        assert 0.0 <= row["personalized_accuracy_unweighted_mean"] <= 1.0
        assert 0.0 <= row["received_accuracy_mean"] <= 1.0
        assert row["bytes_total_mean"] > 0 and row["client_train_seconds_mean"] > 0
    assert again.to_csv() == summarize(tmp_path, labels=list(STRATEGIES), write=False).to_csv()
    for s in STRATEGIES:  # each worker log holds its own run only (a worker runs several jobs)
        for k in (0, 1):
            assert (tmp_path / f"{s}/seed{k}/run.log").read_text().count("round   1/") == 1, (s, k)
            assert any((tmp_path / f"tensorboard/{s}/seed{k}").glob("events.out.tfevents.*")), (s, k)
        assert any((tmp_path / f"tensorboard/{s}/mean").glob("events.out.tfevents.*")), s
    seeds = {json.loads((tmp_path / f"fedit/seed{s}/results.json").read_text())["config"]["train"]["seed"] for s in (0, 1)}
    assert seeds == {0, 1}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--strategies", "fedit,nope"], "unknown strategy 'nope'"),
        (["--strategies", "fedit", "--seeds", "0,x"], "--seeds"),
        (["--strategies", "fedit", "--set", "data.bogus=1"], "unknown config key"),
        (["--strategies", ","], "--strategies is empty"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2_and_runs_nothing(tmp_path: Path, args: list[str], message: str) -> None:
    # Execute
    proc = subprocess.run(
        [sys.executable, "-m", "fedlora.app.cli", "compare", str(SMOKE), "--out", str(tmp_path / "cmp"), *args],
        check=False, capture_output=True, text=True, timeout=120,
    )
    # Assert
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "cmp").exists()


@pytest.mark.slow
def test_cli_compare_on_ray_writes_summary_and_pngs_and_skips_finished_runs(tmp_path: Path) -> None:
    # Prepare: the acceptance command, on Flower's simulation engine
    command = [sys.executable, "-m", "fedlora.app.cli", "compare", str(SMOKE), "--strategies", ",".join(STRATEGIES),
               "--seeds", "0,1", "--out", str(tmp_path)]
    # Execute
    first = subprocess.run(command, check=False, capture_output=True, text=True, timeout=900)
    mtimes = results_mtimes(tmp_path)
    second = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300)
    # Assert
    assert first.returncode == 0, first.stderr[-3000:]
    assert second.returncode == 0, second.stderr[-3000:]
    assert len(mtimes) == 4 and results_mtimes(tmp_path) == mtimes
    assert second.stdout.count("complete, skipped") == 4
    for name in ("summary.csv", "summary.md", *COMPARISON_PLOTS):
        assert (tmp_path / name).stat().st_size > 0, name
    assert "pers. (weighted)" in first.stdout and "every column:" in first.stdout
    assert max(len(line) for line in first.stdout.splitlines() if not line.startswith("round ")) <= 100
    assert "pers. acc (unweighted)" in (tmp_path / "summary.md").read_text()


@pytest.mark.slow
def test_notebook_executes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: a kernelspec for this interpreter (works in a fresh clone, no `jupyter kernelspec
    # install` needed); the parameters papermill-style (a cell after the one tagged `parameters`):
    # the golden tests' cut of the quick config, output in tmp, the "open finished runs" section
    # pointed at tmp (it must find the comparison one level down)
    import nbformat
    from nbclient import NotebookClient

    kernel_dir = tmp_path / "jupyter" / "kernels" / "fedlora-test"
    kernel_dir.mkdir(parents=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "fedlora (test)", "language": "python"}
    (kernel_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    tagged = [i for i, cell in enumerate(notebook.cells) if "parameters" in cell.metadata.get("tags", [])]
    assert len(tagged) == 1
    parameters = (f"OVERRIDES = {list(QUICK_CUT)!r}\nSTRATEGY_OPTIONS = {dict(QUICK_CUT_OPTIONS)!r}\n"
                  f"OUT = {str(tmp_path / 'out')!r}\nFINISHED = {str(tmp_path)!r}")
    notebook.cells.insert(tagged[0] + 1, nbformat.v4.new_code_cell(parameters))
    # Execute
    NotebookClient(notebook, timeout=900, kernel_name="fedlora-test",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    # Assert: no error; the four methods and their baselines ran on the quick config's cut
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    runs = {p.parent.parent.name for p in (tmp_path / "out").glob("*/seed0/results.json")}
    assert {"fedpissa", "fedhera", "feddr_lora", "fedtreelora", "fedit"} <= runs
    config = json.loads((tmp_path / "out" / "fedit" / "seed0" / "results.json").read_text())["config"]
    assert config["model"]["path"] == "minilm"
    # ... the table twice (after the runs, and reopened from the files), with its legend
    tables = [o["data"]["text/html"] for o in outputs if "pers. acc (unweighted)" in o.get("data", {}).get("text/html", "")]
    rows = [sorted(re.findall(r"<tr>.*?</tr>", table, flags=re.DOTALL)) for table in tables]
    assert len(tables) == 2 and rows[0] == rows[1] and len(rows[0]) == 7  # 7 strategies, in any order
    # ... progress lines while it ran; figures inline (label distribution, 4 methods, bytes,
    # distribution, the reopened comparison), none read from a PNG file
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "round   2/2" in text
    figures = [o for o in outputs if o.get("output_type") == "display_data" and "image/png" in o.get("data", {})]
    assert len(figures) == 8
    assert not any("Image(" in cell.source for cell in notebook.cells)
