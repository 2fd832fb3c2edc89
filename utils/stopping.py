"""Stopping together: a stop signal (preemption's SIGTERM, Ctrl-C's SIGINT) or a non-finite loss or weight on any
rank stops every rank after the same step, where the run can save and exit cleanly; and early stopping (patience)."""

import math
import signal
import time

import torch
import torch.distributed as dist

from utils.distributed import ending
from utils.watchdog import waiting
from utils.general import LOCAL_RANK, LOGGER, SharedError, end_on_interrupt
from utils.metrics import BEST_METRIC_NAMES
from utils.torch_utils import de_parallel

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopVote:
    """Each step every rank casts a vote (a stop signal arrived; this step's loss is not finite); the votes are
    combined over ranks in the background and counted one step later, so no step waits for the collective (on
    CUDA the host then waits at most for the previous step's work, which it rarely runs far ahead of).

    Use as a context manager around training: it catches SIGTERM and SIGINT, which then only ask for a stop. A
    second Ctrl-C more than a second after the first (torchrun passes the first one on as well) quits at once.
    `device` (where the votes are combined) must be set before the first vote. A stop signal before `started` (set
    as the run directory is made: start-up, a download, a cache being written) ends the process at once, with
    nothing to save (end_on_interrupt): a scheduler's SIGTERM must not wait for a first step that may be minutes
    away.
    """

    def __init__(self, device=None):
        self.device, self.signal, self.signal_time, self.pending, self.previous_handlers = device, None, 0.0, None, {}
        self.started = False

    def __enter__(self):
        self.previous_handlers = {s: signal.signal(s, self.on_signal) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous_handlers.items():
            signal.signal(s, handler)

    def on_signal(self, signum, frame):
        """Note the first stop signal; the training loop acts on it at the next step boundary."""
        if ending():  # torchrun stops this rank for another's failure, which the watch thread says
            return
        if not self.started:
            end_on_interrupt(signum)
        if self.signal is None:
            self.signal, self.signal_time = signum, time.monotonic()
            if LOCAL_RANK == 0:  # torchrun passes a signal on to every rank: said once on each machine's console
                LOGGER.warning(f"\n{signal.Signals(signum).name}: stopping after the current step to save a checkpoint")
        elif signum == signal.SIGINT and time.monotonic() - self.signal_time > 1:
            raise KeyboardInterrupt

    def cast(self, loss, step):
        """Vote on step `step` (this rank's loss of it on the device); return the verdict of the previous vote."""
        verdict = self.count()
        if loss.device.type == "cpu":  # reading a CPU loss waits for nothing: two bools, not five small tensor ops
            flags = torch.tensor([not math.isfinite(loss.item()), self.signal is not None], dtype=torch.uint8)
        else:
            bad = ~torch.isfinite(loss.detach())
            flags = torch.stack([bad, torch.full_like(bad, self.signal is not None)]).to(torch.uint8)
        # Combined with MAX: any rank's flag.
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True) if dist.is_initialized() else None
        event = None
        if self.device.type == "cuda":  # read later from pinned memory, after an event: the host never stalls
            if work is not None:
                work.wait()  # on nccl: the current stream waits, not the host
                work = None
            flags = flags.to("cpu", non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self.pending = (step, flags, work, event)
        return verdict

    def count(self):
        """The verdict of the pending vote, if any: (stop asked, step whose loss was not finite, or None)."""
        if self.pending is None:
            return False, None
        step, flags, work, event = self.pending
        self.pending = None
        if work is not None:
            with waiting():  # for every rank's vote: a rank that has not cast it is named if it stands still
                work.wait()
        if event is not None:
            event.synchronize()
        bad, stop = flags.tolist()
        return bool(stop), step if bad else None

    def settle(self, loss=None, step=-1):
        """Count the pending vote, then vote once more and wait for it: every rank calls this together, e.g. after
        an epoch's last step, which not every rank took (loss: this rank's loss of it, None if it did not take it).
        Returns the combined verdict."""
        stop, bad_step = self.count()
        if loss is None:
            loss = torch.zeros((), device=self.device)
        self.cast(loss, step)  # step -1: the weights, not a step's loss, were voted on
        last_stop, last_bad = self.count()
        return stop or last_stop, bad_step if bad_step is not None else last_bad


def weights_sum(model):
    """A number that is not finite if any weight is, voted on before each save: a step whose loss was finite but
    whose gradients overflowed must not be saved either."""
    return torch.stack([p.detach().float().sum() for p in de_parallel(model).parameters()]).sum()


def check_vote(verdict, epoch, steps):
    """The vote's stop flag; a non-finite loss (or weights) on any rank ends the run on every rank, unsaved."""
    stop, bad_step = verdict
    if bad_step == -1:
        raise SharedError(f"the weights became non-finite (nan or inf) in epoch {epoch + 1}; stopped "
                          f"without saving, so weights/last.pt keeps the last good state. Lower optim.lr, set "
                          f"optim.clip_grad_norm, or train in fp32")
    if bad_step is not None:
        raise SharedError(f"the training loss is not finite (nan or inf) at epoch {epoch + 1}, step {bad_step + 1}/"
                          f"{steps}; stopped without saving, so weights/last.pt keeps the last good state. Lower "
                          f"optim.lr, set optim.clip_grad_norm, or train in fp32")
    return stop


def wants_save(every, global_step, step, steps):
    """A mid-epoch save every `every` steps, except at the epoch's end, which saves anyway."""
    return bool(every) and global_step % every == 0 and step < steps


def record_best(state, metrics, epoch):
    """Keep the epoch's val score of train.best_metric in state if it is the best so far, taking the better of the
    weights' and their EMA's; returns (whether it improved, whether the EMA's was the better)."""
    name = state.best_metric
    ema_better = state.ema is not None and metrics[f"val/ema_{name}"] > metrics[f"val/{name}"]
    score = metrics[f"val/ema_{name}"] if ema_better else metrics[f"val/{name}"]
    improved = score > state.best_score
    if improved:
        state.best_score, state.best_epoch = score, epoch + 1
    return improved, ema_better


def out_of_patience(patience, state, epochs):
    """Early stopping: whether `patience` epochs have passed without a better val score of train.best_metric (every
    rank agrees: the metrics are the same everywhere)."""
    waited = state.epoch - state.best_epoch
    if not patience or state.epoch >= epochs or waited < patience:
        return False
    LOGGER.info(f"Stopping early after epoch {state.epoch}: no better {BEST_METRIC_NAMES[state.best_metric]} in "
                f"{waited} epoch{'s' * (waited != 1)} since the best, {state.best_score:.2%} at epoch "
                f"{state.best_epoch} (train.patience={patience})")
    return True
