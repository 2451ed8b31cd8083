"""`checkpoint.publish_every`: which policy versions go to the store, and the lineage of those that do not.

With `checkpoint.publish_every: N` > 1 (only with `sync.method: live`, configs/schema.py) a version is
uploaded (and registered as an MLflow model version) only where `publish_due` says so. In between,
the training actor holds the weights and the optimizer state in memory (TrainWorker.load answers
"cached" for the version it just trained, as with checkpoint.optimizer_every) and the generation
actors already serve the weights by live sync, so nothing downstream reads the store for them; the
rollout table of every iteration is still published (tasks/stages/reference.py).

A published version's manifest names its nearest published ancestor as parent and lists the
iterations skipped since it, each with its rollout table (`unpublished_since`), so lineage stays
whole. A run killed between publishes resumes from its newest published version (tasks/stages/prepare.py
`resume_point`) and runs the iterations after it again: at one torch thread they give the same
samples and updates, so the run ends with the same weights as one never killed
(tests/tasks/loop/test_publish_plan.py).

In a fused task with live sync a due version's publish runs in a background thread
(`BackgroundPublish`) overlapping the next iteration: one in flight, joined before the next
publish, before an evaluation and at the task's end.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from tasks.run.keys import is_policy_of, parse_policy_key, rollout_table_key
from tasks.loop.recipe import evaluates
from tasks.run.replay import trainer_state_due
from tasks.run.types import PolicyRef, RunSpec

UNPUBLISHED = "unpublished_iterations"  # manifest metadata of a published version: the skipped iterations since its parent


def publish_due(iteration: int, every: int, last: int, eval_every: int, actor_kept: bool) -> bool:
    """Whether iteration `iteration`'s version is published: `every` (checkpoint.publish_every) divides
    it, it is the run's `last`, an evaluation follows it (loop.eval_every: tasks/loop/recipe.py `evaluates`),
    or the training actor that holds it in memory does not live on to the next iteration (`actor_kept`
    False: the last iteration of a fused task, or a Ray cluster per task)."""
    # the versions that hold trainer_state.pt under optimizer_every = every, plus the evaluated ones
    return trainer_state_due(iteration, every, last, actor_kept) or evaluates(iteration, last, eval_every)


def unpublished_since(store, spec: RunSpec, parent: str) -> tuple[str, list[dict]]:
    """(ancestor, skipped): `parent`'s nearest published ancestor (itself when published) and the
    versions between, oldest first, each as {"iteration", "key", "rollout_table"}. The walk goes
    through the rollout tables, whose first parent is the policy that sampled them -- with live sync
    (no lag) the one that iteration's update started from."""
    skipped = []
    while is_policy_of(spec.run_id, parent) and not store.exists(parent):
        iteration = parse_policy_key(parent).version
        table = rollout_table_key(spec, iteration)
        skipped.append({"iteration": iteration, "key": parent, "rollout_table": table})
        parent = store.manifest(table).parents[0]
    return parent, skipped[::-1]


class BackgroundPublishError(RuntimeError):
    """A publish that ran in the background failed; names the version."""


class BackgroundPublish:
    """One publish in flight in a background thread (tasks/stages/fused.py with sync.method live, where the
    generators never wait for the store): `submit` starts one after joining the one before, `join`
    waits for it and re-raises its failure naming the version. `done` maps each joined version to the
    PolicyRef the publish returned (with its MLflow model version)."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flyroll-publish")
        self._inflight: tuple[int, Future] | None = None
        self.done: dict[int, PolicyRef] = {}

    def submit(self, version: int, publish: Callable[..., PolicyRef], /, **kwargs) -> None:
        self.join()
        self._inflight = (version, self._pool.submit(publish, **kwargs))

    def join(self) -> None:
        if self._inflight is None:
            return
        (version, future), self._inflight = self._inflight, None
        try:
            self.done[version] = future.result()
        except Exception as e:
            raise BackgroundPublishError(f"background publish of policy v{version} failed: {type(e).__name__}: {e}") from e

    def published(self, policy: PolicyRef) -> PolicyRef:
        """`policy` as the store holds it, once any publish in flight has ended (its model version set)."""
        self.join()
        return self.done.get(policy.version, policy)

    def close(self) -> None:
        """Wait for the publish in flight; called on the way out, so its failure is printed, not
        raised over the error already on its way (a clean exit joins first)."""
        try:
            self.join()
        except BackgroundPublishError as e:
            print(f"flyroll: {e}", flush=True)
        finally:
            self._pool.shutdown(wait=True)
