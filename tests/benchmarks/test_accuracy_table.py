"""The seed-averaged accuracy table of benchmarks/accuracy.py, against hand-computed values."""
import pytest

from benchmarks.accuracy import VARIANTS, summarize
from dgt.config import Config


def row(variant, seed, accuracy, loss=1.0, udp=""):
    return {"variant": variant, "seed": seed, "accuracy": accuracy, "final_loss": loss,
            "udp_loss_rate": udp}


def test_mean_spread_and_gap_to_dist_sync():
    rows = [row("dist_sync", 0, 0.70), row("dist_sync", 1, 0.80),
            row("dgt-ef", 0, 0.60, 2.0, 0.9), row("dgt-ef", 1, 0.72, 1.0, 0.8)]
    lines = summarize(rows, ["dgt-ef", "dist_sync"]).splitlines()
    ef = next(line for line in lines if line.startswith("| dgt-ef "))
    cells = [c.strip() for c in ef.strip("|").split("|")]
    # mean 0.66, sample std of (0.60, 0.72) = 0.0849; dist_sync mean 0.75 -> gap -9.0 points;
    # same seed: -10 and -8 points -> -9.0, sample std 1.41
    assert cells == ["dgt-ef", "2", "0.6000 / 0.7200", "0.6600 ± 0.0849", "-9.0", "-9.0 ± 1.4",
                     "1.500", "85.0%"]
    base = next(line for line in lines if line.startswith("| dist_sync "))
    assert "| +0.0 | +0.0 ± 0.0 |" in base and "| - |" in base


def test_without_a_baseline_the_gap_is_left_blank():
    table = summarize([row("dgt", 0, 0.5)], ["dgt"])
    assert table.splitlines()[-1].split("|")[5].strip() == "-"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_variant_is_a_valid_dgt_configuration(variant):
    kvstore, settings = VARIANTS[variant]
    config = Config.from_env(dict(settings, DGT_UDP_DROP="0.9", DGT_SEED="1"))
    assert config.udp_drop == 0.9 and (kvstore == "dgt" or not settings)


def write_csv(path, rows):
    import csv

    from benchmarks.accuracy import COLUMNS
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({"model": "alexnet", "steps": 200, "update_on_kvstore": "0",
                             "udp_drop": 0.9 if r["variant"] != "dist_sync" else "",
                             "wall_s": 1.0, **r})


def test_from_csv_combines_seeds_of_several_runs(tmp_path, monkeypatch):
    import sys

    from benchmarks import accuracy
    write_csv(tmp_path / "a.csv", [row("dgt", 0, 0.70, 1.0, 0.9), row("dist_sync", 0, 0.72)])
    write_csv(tmp_path / "b.csv", [row("dgt", 1, 0.76, 1.0, 0.9), row("dist_sync", 1, 0.75)])
    monkeypatch.setattr(sys, "argv", [
        "accuracy.py", "--variants", "dgt,dist_sync", "--from-csv", str(tmp_path / "a.csv"),
        "--from-csv", str(tmp_path / "b.csv"), "--name", "both",
        "--results-dir", str(tmp_path)])
    assert accuracy.main() == 0
    text = (tmp_path / "both.md").read_text()
    assert "seeds 0,1" in text and "update_on_kvstore 0" in text
    dgt = next(line for line in text.splitlines() if line.startswith("| dgt "))
    # same seed: -2 and +1 points -> -0.5, sample std 2.1
    assert "| 0.7000 / 0.7600 |" in dgt and "| -0.5 ± 2.1 |" in dgt


def test_from_csv_refuses_a_seed_twice_and_mixed_step_counts(tmp_path):
    from benchmarks.accuracy import read_rows
    write_csv(tmp_path / "a.csv", [row("dgt", 0, 0.70, 1.0, 0.9)])
    write_csv(tmp_path / "b.csv", [row("dgt", 0, 0.71, 1.0, 0.9)])
    with pytest.raises(SystemExit, match="more than one file"):
        read_rows([tmp_path / "a.csv", tmp_path / "b.csv"], ["dgt"], "0")
    write_csv(tmp_path / "c.csv", [dict(row("dgt", 1, 0.7, 1.0, 0.9), steps=300)])
    with pytest.raises(SystemExit, match="steps"):
        read_rows([tmp_path / "a.csv", tmp_path / "c.csv"], ["dgt"], "0")
