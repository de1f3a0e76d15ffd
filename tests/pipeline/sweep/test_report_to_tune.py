"""A sweep trial's validation losses go to Tune on a queue that lives as long as the trial's process.
When Tune stops the trial, a report still in flight finds the queue gone: that is the trial ending,
and must not become a Train controller error (a traceback on the console for every stopped trial)."""

from __future__ import annotations

import pytest

from pipeline.sweep.run import validation_to_tune_class

pytestmark = pytest.mark.slow


def test_reports_with_a_validation_loss_reach_the_queue_and_a_gone_queue_is_the_trial_ending(ray_cluster):
    ray = ray_cluster
    from ray.util.queue import Queue

    cls = validation_to_tune_class()
    callback = cls.__new__(cls)  # its own __init__ asks for a Tune session; the queue is what it sets up
    callback._training_actor_item_queue = queue = Queue()
    callback.after_report(None, [{"step": 25, "val_loss": 4.5, "lr": 1e-3}], None)
    callback.after_report(None, [{"step": 30}], None)  # a checkpoint's report: no validation loss, not sent
    assert queue.qsize() == 1 and queue.get(timeout=30) == {"step": 25, "val_loss": 4.5}

    ray.kill(queue.actor)  # the trial's process is gone, and its queue with it
    callback.after_report(None, [{"step": 50, "val_loss": 4.2}], None)  # dropped, not raised

    class Broken:
        def put(self, item):
            raise ValueError("not a lost queue")

    callback._training_actor_item_queue = Broken()
    with pytest.raises(ValueError):  # anything else still fails the training
        callback.after_report(None, [{"step": 75, "val_loss": 4.0}], None)
