"""The run's layout named once (``rstarjax.layout``, issue 49): each of the four layouts from the
config and the process count, which process only rolls out, which devices the trainer takes, and
which rollout processes each trainer drives, checked against the layouts docs/training.md
"Placement" describes (written out here by hand)."""
import dataclasses

import pytest

from rstarjax.layout import Layout, distributed_trainers, layout_of


@dataclasses.dataclass
class Serving:  # the fields of serving.colocated.ServingConfig the layout reads
    placement: str = "colocated"
    trainer_processes: int = 1
    rollout_devices: int = 0


@dataclasses.dataclass
class Device:
    id: int
    process_index: int


def test_colocated_one_or_several_processes_train_everywhere():
    one = layout_of(Serving(), processes=1, process=0)
    assert one.kind is Layout.COLOCATED and one.single_process and not one.several_trainers
    assert not one.rolls_out_only and not one.rollouts_apart
    assert one.trainer_devices([Device(0, 0), Device(1, 0)]) is None  # every device
    several = layout_of(Serving(), processes=4, process=3)
    assert several.kind is Layout.COLOCATED and several.trainers == 4 and several.several_trainers
    assert not several.rolls_out_only and several.rollout_processes() == ()
    assert distributed_trainers(Serving()) == 0


def test_disaggregated_in_one_process_splits_its_devices():
    lay = layout_of(Serving("disaggregated", rollout_devices=2), processes=1, process=0)
    assert lay.kind is Layout.DISAGGREGATED and lay.rollouts_apart and lay.single_process
    devices = [Device(i, 0) for i in range(8)]
    assert [d.id for d in lay.trainer_devices(devices)] == [0, 1, 2, 3, 4, 5]  # the last two roll out


@pytest.mark.parametrize("process, rolls_out, drives", [(0, False, (2, 4)), (1, False, (3, 5)),
                                                         (2, True, ()), (5, True, ())])
def test_rollout_processes_past_the_trainers_only_roll_out(process, rolls_out, drives):
    serving = Serving("disaggregated", trainer_processes=2, rollout_devices=2)
    lay = layout_of(serving, processes=6, process=process)
    assert lay.kind is Layout.ROLLOUT_PROCESSES and lay.several_trainers and not lay.single_process
    assert lay.rolls_out_only == rolls_out
    if not rolls_out:
        assert lay.rollout_processes() == drives  # every 2nd process past the two trainers
    devices = [Device(2 * p + i, p) for p in range(6) for i in range(2)]
    assert [d.id for d in lay.trainer_devices(devices)] == [0, 1, 2, 3]  # the training processes' own
    assert distributed_trainers(serving) == 2


def test_only_a_colocated_run_on_one_device_takes_turns_on_it():
    """The memory plan's start check (``recipes.rl.check_update_room``) asks this, not the device count."""
    assert layout_of(Serving(), processes=1, process=0, devices=1).one_device
    assert not layout_of(Serving(), processes=1, process=0, devices=8).one_device
    assert not layout_of(Serving("disaggregated", rollout_devices=1), processes=1, process=0, devices=2).one_device


def test_the_stage_loop_and_the_step_read_no_mode_flag_nor_process_count():
    """recipes/rl.py asks the rollout source (``recipes.sources``) and the layout; rl/step.py is
    told the mode by the source's round and asks the training processes' collectives
    (``rstarjax.processes``): neither names a mode flag, the placement or a process count in its
    code (docstrings and comments may speak of them)."""
    import io
    import tokenize

    from rstarjax.recipes import rl
    from rstarjax.rl import step

    banned = {"partial_rollout_tokens", "max_staleness", "training_count", "process_count", "device_count",
              "disaggregated", "placement", "trainer_processes"}
    for module in (rl, step):
        with open(module.__file__) as f:
            names = {t.string for t in tokenize.generate_tokens(io.StringIO(f.read()).readline)
                     if t.type == tokenize.NAME}
        assert not names & banned, (module.__name__, sorted(names & banned))
