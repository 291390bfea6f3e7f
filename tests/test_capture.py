"""The captured step's refusals that need more than one process or an
optimizer to reach (pyddp/engine/streams.py, StepCapture): named before anything is
queued. The captured step itself runs in the simulated tier
(tests/test_simgpu_capture.py)."""

from types import SimpleNamespace

import pytest

from pyddp.engine.streams import StepCapture


def _reducer(spans=False, pending=False, scattered=None, learning=False):
    return SimpleNamespace(
        _gpu_devices=None,  # (the driver's capture support is asked on GPUs only)
        _link=SimpleNamespace(spans_processes=spans),
        _plan=SimpleNamespace(rebuild_pending=pending),
        _engine=SimpleNamespace(learning=learning),
        _layout=SimpleNamespace(scattered=scattered),
    )


@pytest.mark.parametrize(
    "state, words",
    [
        ({"spans": True}, "it spans processes"),
        ({"pending": True}, "no synced backward ran yet"),
        ({"learning": True}, "static_graph's first one counts"),
        ({"scattered": object()}, "the gradients are sharded"),
    ],
)
def test_a_step_that_cannot_be_captured_is_refused_by_name(state, words):
    capture = StepCapture()
    with pytest.raises(RuntimeError, match="cannot be captured into a CUDA graph") as e:
        capture.begin(_reducer(**state), 0)
    assert words in str(e.value)
    assert not capture.active  # nothing of the step is kept


def test_replicas_that_capture_and_replicas_that_do_not_are_refused():
    capture = StepCapture()
    capture.begin(_reducer(), 0)
    with pytest.raises(RuntimeError, match="every replica's stream must take part"):
        capture.begin_eager(1)
    capture.reset()
    capture.begin_eager(0)
    with pytest.raises(RuntimeError, match=r"replicas \[0\] started this step on streams that"):
        capture.begin(_reducer(), 1)
    capture.reset()
    capture.begin_eager(0)  # a forward with no backward, then replica 0 again, captured
    capture.begin(_reducer(), 0)
    capture.begin(_reducer(), 1)
    capture.check_end(2, [])
    assert capture.ended() and capture.backwards == 1
    capture.begin_eager(0)
    assert not capture.ended() and capture.backwards == 1 and not capture.eager
    capture.begin(_reducer(), 1)
    with pytest.raises(RuntimeError, match=r"replicas \[0\] ran no forward on a capturing"):
        capture.check_end(2, [])
    capture.begin(_reducer(), 0)
    capture.begin(_reducer(), 1)
    with pytest.raises(RuntimeError, match="no gradient for replica 1 parameter 3"):
        capture.check_end(2, [(1, 3)])
    capture.begin(_reducer(), 0)
    capture.begin(_reducer(), 1)
    capture.check_end(2, [])
    assert capture.ended() and capture.backwards == 2 and not capture.active
