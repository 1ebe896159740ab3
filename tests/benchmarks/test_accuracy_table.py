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
