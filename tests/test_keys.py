"""pulseloco.keys: one naming scheme for every DHT record of a run."""

from __future__ import annotations

from pulseloco import keys


def test_every_record_of_a_run_is_under_its_own_prefix_and_no_two_collide() -> None:
    run = "my-run"
    sync = keys.policy_run_id(run)
    assert sync == "my-run.policy" and keys.training_run_id(sync) == run and keys.training_run_id(run) == run
    names = [
        keys.loco_round_key(run, 3, "peers"),
        keys.loco_round_key(run, 3, "view0"),
        keys.loco_round_key(run, 4, "peers"),
        keys.loco_state_key(run),
        keys.head_key(sync),
        keys.providers_key(sync),
        keys.workers_key(sync),
        keys.refused_key(sync),
    ]
    assert all(name.startswith("pulseloco:my-run") for name in names)
    assert len(set(names)) == len(names)
    assert keys.loco_state_key(run) == "pulseloco:my-run:loco:state"
    assert keys.head_key(sync) == "pulseloco:my-run.policy:head"
