"""The code pool's central queue (env/job_queue.py): the staged dispatch serves tool calls before
reward verifications, each stage bounded on its own; "fifo" is one lane in arrival order."""
import concurrent.futures
import threading
import time

import pytest

from rstarjax.env.executor import CodeExecutor
from rstarjax.env.job_queue import Job, JobQueue


def job(i: int, op: str, t: float = 0.0) -> Job:
    return Job(i, op, {}, 1.0, concurrent.futures.Future(), t_submit=t)


def ids(batch):
    return [(j.op, j.id) for j in batch]


def arrivals():
    return [job(0, "verify"), job(1, "exec"), job(2, "verify"), job(3, "exec")]


def test_staged_dispatch_hands_out_tool_calls_first_each_stage_in_arrival_order():
    q = JobQueue(10)
    for j in arrivals():
        assert q.put(j, timeout=0)
    assert len(q) == 4
    assert ids(q.get_batch(3, 0.0, timeout=0)) == [("exec", 1), ("exec", 3), ("verify", 0)]
    assert ids(q.get_batch(3, 0.0, timeout=0)) == [("verify", 2)]


def test_a_batch_is_cut_to_fit_a_frame_and_a_call_alone_always_goes():
    """get_batch(max_bytes=): calls of 40 MB each, 100 MB allowed: two a batch, in order (a
    worker dies of a frame over wire.MAX_FRAME, with every call in flight on it); one call over
    the bound still goes alone (the executor refuses those at submit)."""
    q = JobQueue(10)
    for i, size in enumerate((40, 40, 40, 150, 10)):
        j = job(i, "exec")
        j.wire_bytes = size << 20
        q.put(j, timeout=0)
    batches = [ids(q.get_batch(8, 0.0, timeout=0, max_bytes=100 << 20)) for _ in range(4)]
    assert batches == [[("exec", 0), ("exec", 1)], [("exec", 2)], [("exec", 3)], [("exec", 4)]]
    assert len(q) == 0


def test_fifo_dispatch_hands_out_in_arrival_order():
    q = JobQueue(10, dispatch="fifo")
    for j in arrivals():
        q.put(j, timeout=0)
    assert ids(q.get_batch(4, 0.0, timeout=0)) == [("verify", 0), ("exec", 1), ("verify", 2), ("exec", 3)]


def test_a_full_verification_stage_does_not_block_tool_calls():
    q = JobQueue(2)
    assert q.put(job(0, "verify"), 0) and q.put(job(1, "verify"), 0)
    assert not q.put(job(2, "verify"), timeout=0.05)  # its own stage is full: backpressure
    assert q.put(job(3, "exec"), timeout=0)  # the tool stage still takes calls
    fifo = JobQueue(2, dispatch="fifo")
    assert fifo.put(job(0, "verify"), 0) and fifo.put(job(1, "verify"), 0)
    assert not fifo.put(job(3, "exec"), timeout=0.05)  # one lane: the tool call waits on them


def test_put_front_expire_and_close_keep_every_job_in_its_stage():
    q = JobQueue(10)
    for j in [job(0, "verify", t=1.0), job(1, "exec", t=1.5), job(2, "exec", t=5.0)]:
        q.put(j, 0)
    batch = q.get_batch(2, 0.0, timeout=0)
    q.put_front(batch)  # never dispatched: back at the front of their stages, in order
    assert ids(q.get_batch(3, 0.0, timeout=0)) == [("exec", 1), ("exec", 2), ("verify", 0)]
    for j in [job(0, "verify", t=1.0), job(1, "exec", t=1.5), job(2, "exec", t=5.0)]:
        q.put(j, 0)
    assert sorted(ids(q.expire(older_than=2.0))) == [("exec", 1), ("verify", 0)]
    assert ids(q.close()) == [("exec", 2)]
    assert not q.put(job(9, "exec"), 0) and len(q) == 0


def test_a_waiting_get_wakes_for_a_put_into_any_stage():
    q = JobQueue(4)
    got = []
    t = threading.Thread(target=lambda: got.append(q.get_batch(4, 0.0, timeout=5)))
    t.start()
    time.sleep(0.05)
    q.put(job(7, "verify"), 0)
    t.join(5)
    assert ids(got[0]) == [("verify", 7)]


def test_unknown_dispatch_is_refused():
    with pytest.raises(ValueError, match="dispatch"):
        JobQueue(4, dispatch="lifo")


@pytest.mark.parametrize("dispatch", ["staged", "fifo"])
def test_in_the_pool_a_tool_call_submitted_behind_verifications_runs_before_them(dispatch):
    """One sandbox, busy; five verifications queue, then a tool call: staged runs the tool call
    next, fifo after the five."""
    with CodeExecutor(num_workers=1, lean_workers=0, slots_per_worker=1, inflight_per_worker=1,
                      dispatch=dispatch) as ex:
        order, lock = [], threading.Lock()

        def note(name):
            def done(_):
                with lock:
                    order.append(name)
            return done

        busy = ex.submit("import time\ntime.sleep(0.5)", timeout=10)
        time.sleep(0.2)  # the busy call holds the only slot
        verifies = [ex.submit_verify(r"<answer>\boxed{2}</answer>", "2", timeout=30) for _ in range(5)]
        for k, f in enumerate(verifies):
            f.add_done_callback(note(f"verify{k}"))
        tool = ex.submit("print('tool')", timeout=10)
        tool.add_done_callback(note("tool"))
        assert busy.result(30).kind == "display"
        assert tool.result(30).text == "tool\n"
        assert all(bool(f.result(60)) for f in verifies)
        assert order.index("tool") == (0 if dispatch == "staged" else 5), order
