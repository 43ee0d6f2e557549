"""The placement simulation's claims (docs/SCALE.md) on a small fleet, as properties."""
from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import placement_sim  # noqa: E402


def run() -> dict:
    """20 hosts, 20k sequences, 800 decodes in flight."""
    args = argparse.Namespace(
        hosts=20, workers=100, sequences=20_000, requests=800.0, row_fraction=0.05, zipf=1.0,
        vnodes=100, policies=["rendezvous", "two_choices", "ring", "modulo"], seed=3, json=None)
    return placement_sim.simulate(args)


def test_rendezvous_moves_only_its_share_and_modulo_moves_everything() -> None:
    r = run()
    ideal = 1 / 21
    for policy in ("rendezvous", "ring"):
        p = r["policies"][policy]
        assert abs(p["moved_on_join"] - ideal) < 0.25 * ideal, (policy, p)
        assert abs(p["moved_on_leave"] - 1 / 20) < 0.25 / 20, (policy, p)
    assert r["policies"]["modulo"]["moved_on_join"] > 0.9


def test_two_choices_balances_bytes_better_than_one() -> None:
    r = run()
    one = r["policies"]["rendezvous"]["bytes_max_over_mean"]
    two = r["policies"]["two_choices"]["bytes_max_over_mean"]
    assert two < one
    assert two < 1.05


def test_replicas_survive_failures_and_spread_hot_reads() -> None:
    r = run()
    assert r["replicas_2"]["lost_on_one_failure"] == 0
    assert r["replicas_2"]["lost_on_two_failures"] > 0  # both replicas on the two failed hosts
    assert r["replicas_3"]["lost_on_two_failures"] == 0
    assert (r["replicas_2"]["traffic_max_over_mean_reads_spread"]
            < r["policies"]["rendezvous"]["traffic_max_over_mean"])
