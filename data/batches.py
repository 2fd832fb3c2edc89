"""A training batch from its sample ids to the training device, whatever the storage the samples are read from.

Every training set is a SeededBatches: the DataLoader hands it a batch of sample ids (copy k of sample i is id
i + k * len(dataset): repeated augmentation), its storage reads them (read), and each sample's random augmentation
comes from its own seed (seed, epoch, id) alone: its crop box and flip drawn by seeded_crops where the storage
keeps pixels or JPEG bytes (the RAM cache, the JPEG cache, a shard set), or torch's generator seeded per sample
where a per-image transform draws them (image files, CIFAR's arrays: SeededSamples). A batch is then the same
whichever rank or DataLoader worker reads it, at any number of processes and workers, and a run resumed mid-epoch
redoes any step exactly. A new storage is a SeededBatches with a read method.

batch_to moves a loader's batch to the training device, decoding (decode_jpegs: the one JPEG decoder) and cropping
there what the storage left to it; device_batches does it for a loader, each batch prepared while the step before
it runs.
"""

import functools
import queue
import threading
from contextlib import nullcontext, suppress

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from data.sampler import sample_seed
from data.transforms import crop_batch, crop_params

CPU = torch.device("cpu")


class SeededBatches(Dataset):
    """A training set read a batch at a time. A storage subclasses it with read(ids, index), index = ids % len(self):
    (images, targets, sizes, scales) with images either uint8 pixels (one (N, C, H, W) tensor), a list of JPEG bytes
    (1-D uint8 tensors) or, where no crop is left to draw (sizes None), the finished batch; sizes the (N, 2) (height,
    width) each sample's crop box is drawn on, scales the (N, 2) stored over drawn size. The storage sets seed, spec
    (data/transforms.CropSpec) and on_device (JPEG bytes decoded on the training device, not in the workers)."""

    seed, epoch, spec, on_device = 0, 0, None, False

    def set_epoch(self, epoch):
        """Choose the epoch whose augmentation the next batches draw. The DataLoader's workers are not persistent:
        each epoch's get a fresh copy of the dataset, which has it."""
        self.epoch = epoch

    def __getitems__(self, ids):
        """A batch of sample ids as the loader passes it on: (images, targets); pixels with their (N, 5) crop params
        and scales, for batch_to to crop on the device; JPEG bytes decoded and cropped here (decode_crop), or with
        on_device packed (packed) with their crop params and scales."""
        ids = np.asarray(ids, dtype=np.uint64)
        images, targets, sizes, scales = self.read(ids, (ids % len(self)).astype(np.int64))
        if sizes is None:
            return images, targets
        params = seeded_crops(self.seed, self.epoch, ids, sizes, self.spec)
        if not isinstance(images, list):
            return images, targets, params, scales
        if self.on_device:
            return packed(images), targets, params, scales
        return decode_crop(images, params, scales, self.spec, CPU), targets

    def __getitem__(self, i):
        return tuple(value[0] for value in self.__getitems__([i]))

    def seeded(self, sample_id, make):
        """make() with torch's CPU generator seeded for sample_id in this epoch (sample_seed), the caller's state
        restored afterwards: with no workers the main process's stream (dropout, ...) is left as it was. The CPU
        generator alone: torch.manual_seed would also reseed every GPU's stream."""
        state = torch.get_rng_state()
        torch.default_generator.manual_seed(sample_seed(self.seed, self.epoch, sample_id))
        try:
            return make()
        finally:
            torch.set_rng_state(state)


class SeededSamples(SeededBatches):
    """A dataset of (image, target) samples with a per-image transform (image files, CIFAR's arrays) as a training
    set: sample i's random transforms in epoch e draw from torch's generator seeded by (seed, e, i) alone."""

    def __init__(self, dataset, seed=0):
        self.dataset, self.seed = dataset, seed

    def read(self, ids, index):
        images, targets = default_collate([self.seeded(int(i), lambda k=int(k): self.dataset[k])
                                           for i, k in zip(ids, index)])
        return images, targets, None, None

    def __getitem__(self, i):
        return self.seeded(i, lambda: self.dataset[i % len(self.dataset)])

    def __len__(self):
        return len(self.dataset)


def seeded_crops(seed, epoch, ids, sizes, spec):
    """(N, 5) int64 crop params of sample ids in an epoch, drawn from each id's seed on its (N, 2) (height, width)
    sizes: the per-image path's crop box and flip of each sample."""
    return torch.from_numpy(crop_params(sample_seed(seed, epoch, ids), sizes[:, 0], sizes[:, 1], spec))


def keep_batch(batch):
    """collate_fn for the datasets whose __getitems__ returns whole batches: every SeededBatches."""
    return batch


def packed(blobs):
    """A batch's JPEG bytes as one flat uint8 tensor and their lengths (unpacked by batch_to): two tensors cross from
    a DataLoader worker to the training process, not one per image, each of which costs a shared-memory file and
    its mapping (a list of 256 held a loader under 3,500 images/s on a 2-core CPU; packed, over 12,000)."""
    flat = torch.cat(blobs) if blobs else torch.empty(0, dtype=torch.uint8)
    return flat, torch.tensor([len(blob) for blob in blobs], dtype=torch.int64)


def decode_jpegs(blobs, device):
    """JPEG bytes (a list of 1-D uint8 CPU tensors) as RGB uint8 (C, H, W) images on device, in one call: every
    JPEG this project decodes from bytes goes through here. TorchCodec's decoder (libjpeg-turbo on the CPU, nvJPEG on
    CUDA; torchvision's own decode_jpeg is deprecated in its favour, and gives the same pixels), imported here, where
    it is used: 50-70 ms that a run of the RAM cache does not pay."""
    from torchcodec.decoders import decode_jpeg

    return decode_jpeg(blobs, mode="RGB", device=device)


def decode_crop(blobs, params, scales, spec, device):
    """The JPEG cache's training batch: JPEG bytes (a list of 1-D uint8 CPU tensors) decoded in one call on device
    (decode_jpegs), then cropped and flipped (crop_batch: at once on a GPU, one image at a time on a CPU) into one
    uint8 (N, C, size, size) batch."""
    return crop_batch(decode_jpegs(blobs, device), params.to(device, non_blocking=True), spec, scales)


def batch_to(batch, device, spec):
    """A loader's batch on device as (uint8 images, targets); the RAM cache's training batches are cropped and
    flipped there (crop_batch), the JPEG cache's JPEG bytes (a list) decoded, cropped and flipped there
    (decode_crop), given packed (packed) or as a list."""
    images, targets, *crop = batch
    if isinstance(images, tuple):
        flat, lengths = images
        images = list(flat.split(lengths.tolist()))
    if isinstance(images, list):
        return decode_crop(images, *crop, spec, device), targets.to(device, non_blocking=True)
    images, targets, *crop = (tensor.to(device, non_blocking=True) for tensor in batch)
    return (crop_batch(images, crop[0], spec, *crop[1:]) if crop else images), targets


def device_batches(loader, device, spec, ahead=None):
    """The loader's batches on device as batch_to makes them, in order. On CUDA (ahead: by default, on CUDA only)
    each is prepared while the step before it runs: a thread takes the loader's batches and moves, decodes and crops
    them on a side stream, one batch ahead of the training loop, so that its waits (nvJPEG's decoder blocks the
    calling thread until its batch is done) hold up neither the queueing of the step's kernels nor the step. The
    training stream waits for a batch's work (an event) before using it, and its tensors are marked as used there
    (record_stream), so that their memory is not reused while the step reads them. An error in the loader or the
    preparation is raised here, in the training loop, as it was raised. Costs up to two batches on the device beyond
    the one training. Use as a context manager (or close it): leaving the loop early stops the thread before the
    loader is used again. On a CPU the batches are prepared in line: the step already has the cores (the README's
    first command, 5 alternated launches: 0.98x of the time before this function with batches in line, 1.03x with
    the thread, within a spread of about 8%)."""
    if not (device.type == "cuda" if ahead is None else ahead):
        yield from (batch_to(batch, device, spec) for batch in loader)
        return
    stream = side_stream(device) if device.type == "cuda" else None
    ready, stop = queue.Queue(maxsize=1), threading.Event()
    worker = threading.Thread(target=prepare_batches, args=(loader, device, spec, stream, ready, stop), daemon=True,
                              name="device_batches")
    worker.start()
    try:
        while (item := ready.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            tensors, done = item
            if stream is not None:
                current = torch.cuda.current_stream(device)
                current.wait_event(done)
                for tensor in tensors:
                    tensor.record_stream(current)
            yield tensors
    finally:
        stop.set()
        while worker.is_alive():  # a thread blocked on a full queue sees stop within its timeout
            with suppress(queue.Empty):
                ready.get(timeout=0.1)
            worker.join(timeout=0.1)


@functools.cache
def side_stream(device):
    """One side stream per device for all epochs: the caching allocator keeps freed memory for reuse on the stream
    that allocated it, so a new stream each epoch would strand the last one's."""
    return torch.cuda.Stream(device)


def prepare_batches(loader, device, spec, stream, ready, stop):
    """device_batches' thread: each of the loader's batches through batch_to on stream, put on ready with the event
    that marks its work done; then None, or the error met. Ends early once stop is set."""
    def put(item):
        while not stop.is_set():
            with suppress(queue.Full):
                return ready.put(item, timeout=0.1)

    try:
        with torch.cuda.device(device) if stream is not None else nullcontext(), \
                torch.cuda.stream(stream) if stream is not None else nullcontext():
            for batch in loader:
                tensors = batch_to(batch, device, spec)
                put((tensors, stream.record_event() if stream is not None else None))
                if stop.is_set():
                    return
        put(None)
    except BaseException as error:  # noqa: BLE001 - handed to the training loop, which raises it
        put(error)
