"""Where prepare's tasks run: in this process, in local worker processes, or on Ray.

Every executor has one method, `map(fn, items, on_done)`: it runs `fn(item, *args)` for each item, calls
`on_done(index, result)` as tasks finish (in completion order, for progress) and returns the results in
item order. Tasks write their own files and return small counters, so the output never depends on which
worker ran a task or when it finished.

- `inline` (data.workers: 1): a plain loop here.
- `local`: a process pool of `data.workers` processes (fork on Linux: no re-import per worker). Each
  worker's tokenizer runs single-threaded, so N workers use N cores.
- `ray`: `ray.init(address=data.ray_address)`; with no address an embedded local Ray is started with
  `data.workers` CPUs (default: all cores) and stopped at the end. One CPU per task. The data dir must be
  on storage every Ray node sees (a shared file system), since tasks read and write `_work/` there.
  A start or connection that fails is one message with what to try (address, token, `--num-cpus`, the
  local executor), exit 2: Ray itself retries a dead address for minutes and then raises its raw
  exception, so a `host:port` address is first probed with one TCP connect.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from types import TracebackType
from typing import Any

from leantrain.errors import UserInputError
from leantrain.spec.schema import DataSpec

OnDone = Callable[[int, Any], None]


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _single_threaded_worker() -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: N workers, N cores
    os.environ.setdefault("OMP_NUM_THREADS", "1")


class Executor:
    """Runs tasks in this process, one after the other (`data.workers: 1`)."""

    name = "inline"
    num_workers = 1

    def map(self, fn: Callable[..., Any], items: Sequence[Any], args: tuple[Any, ...], on_done: OnDone | None = None
            ) -> list[Any]:
        results = []
        for index, item in enumerate(items):
            results.append(fn(item, *args))
            if on_done is not None:
                on_done(index, results[-1])
        return results

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        pass


class LocalExecutor(Executor):
    """A pool of worker processes on this machine."""

    name = "local"

    def __init__(self, num_workers: int) -> None:
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        self.num_workers = num_workers
        self._pool = ProcessPoolExecutor(max_workers=num_workers, mp_context=multiprocessing.get_context(method),
                                         initializer=_single_threaded_worker)
        # Fork the workers now, before the caller starts threads (rich's progress refresher): a fork while
        # another thread holds a lock would leave the child with that lock held.
        self._pool.submit(os.getpid).result()

    def map(self, fn: Callable[..., Any], items: Sequence[Any], args: tuple[Any, ...], on_done: OnDone | None = None
            ) -> list[Any]:
        futures: dict[Future[Any], int] = {self._pool.submit(fn, item, *args): i for i, item in enumerate(items)}
        results: list[Any] = [None] * len(items)
        pending = set(futures)
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in sorted(done, key=futures.__getitem__):
                    results[futures[future]] = future.result()  # re-raises a task's error here
                    if on_done is not None:
                        on_done(futures[future], results[futures[future]])
        finally:
            for future in pending:
                future.cancel()
        return results

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


TASK_RETRIES = 2  # a task whose worker or node dies runs again elsewhere (tasks are idempotent: see tasks.py)


class RayExecutor(Executor):
    """Tasks as Ray remote functions, one CPU each, on a cluster or an embedded local Ray."""

    name = "ray"

    def __init__(self, *, address: str | None, num_workers: int | None) -> None:
        import ray

        self._ray = ray
        self._started = not ray.is_initialized()
        if self._started:
            env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}}
            if address is not None:
                probe_address(address)
            try:
                if address is None:
                    ray.init(num_cpus=num_workers or default_workers(), include_dashboard=False,
                             log_to_driver=False, runtime_env=env)
                else:
                    ray.init(address=address, log_to_driver=False, runtime_env=env)
            except Exception as err:  # noqa: BLE001 - Ray raises plain Exception, RuntimeError, ConnectionError ...
                ray.shutdown()  # whatever half-started
                raise ray_start_error(address, err) from None
        self.num_workers = int(ray.cluster_resources().get("CPU", 1))
        self._remote: dict[Callable[..., Any], Any] = {}

    def map(self, fn: Callable[..., Any], items: Sequence[Any], args: tuple[Any, ...], on_done: OnDone | None = None
            ) -> list[Any]:
        ray = self._ray
        remote = self._remote.setdefault(fn, ray.remote(num_cpus=1, max_retries=TASK_RETRIES)(fn))
        shared = [ray.put(arg) for arg in args]
        refs = {remote.remote(item, *shared): i for i, item in enumerate(items)}
        results: list[Any] = [None] * len(items)
        pending = list(refs)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                for ref in done:
                    try:
                        results[refs[ref]] = ray.get(ref)
                    except ray.exceptions.RayTaskError as err:
                        raise err.cause from None  # the task's own error (e.g. a bad input file)
                    except ray.exceptions.RayError as err:  # a node or worker lost beyond the task retries
                        raise UserInputError(
                            f"Ray lost a prepare task beyond its {TASK_RETRIES} retries ({type(err).__name__}: "
                            f"{str(err).strip().splitlines()[0][:300]}); run the same command again: finished "
                            "tasks are kept (crash-resume), or use data.executor: local") from None
                    if on_done is not None:
                        on_done(refs[ref], results[refs[ref]])
        finally:
            for ref in pending:
                ray.cancel(ref)
        return results

    def close(self) -> None:
        if self._started:
            self._ray.shutdown()


RAY_HINTS = (
    "what to try: the address (`ray status` on the head node prints it; `auto` works only on a node of the "
    "cluster, ray://HEAD:10001 through Ray Client from outside); the token (Ray 2.60 turns on token "
    "authentication: export RAY_AUTH_MODE=token and the cluster's RAY_AUTH_TOKEN here and on every node, or "
    "RAY_AUTH_MODE=disabled for a cluster started without it); on a loaded machine a smaller embedded Ray "
    "(data.workers, like `ray start --num-cpus`); or data.executor: local (the same data dir, local processes)"
)


def probe_address(address: str, *, timeout_s: float = 5.0) -> None:
    """A `host:port` or `ray://host:port` address must accept a TCP connection (Ray would retry a dead one
    for minutes); `auto` and other forms are left to Ray."""
    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as err:
        raise UserInputError(f"data.ray_address {address}: nothing answers there ({err}); {RAY_HINTS}") from None


def ray_start_error(address: str | None, err: BaseException) -> UserInputError:
    """One message for a Ray start or connection that failed: Ray's own words (first line) and what to try."""
    first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
    if address is None:
        what = "could not start an embedded Ray (data.executor: ray without data.ray_address)"
    else:
        what = f"could not connect to the Ray cluster at data.ray_address {address}"
    said = " ".join(str(e) for e in (err, err.__cause__, err.__context__) if e is not None).lower()
    if "auth" in said or "token" in said:  # Ray words the refusal in the cause: "InvalidAuthToken", "token"
        what += " (token authentication)"
    return UserInputError(f"{what}: {type(err).__name__}: {first}; {RAY_HINTS}")


def make_executor(spec: DataSpec, *, num_tasks: int) -> Executor:
    """The executor for `data.executor` / `data.workers` (no more local processes than tasks)."""
    if spec.executor == "ray":
        return RayExecutor(address=spec.ray_address, num_workers=spec.workers)
    workers = min(spec.workers or default_workers(), max(num_tasks, 1))
    return Executor() if workers <= 1 else LocalExecutor(workers)
