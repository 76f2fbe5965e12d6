"""Checkpoints of a pipeline that load into any number of stages, stored with
``torch.distributed.checkpoint`` (DCP).

Every layer's parameters and buffers are saved under the layer's *global* index (``model.12.weight``
is the weight of the model's layer 12, whichever stage and rank held it), and an optimizer's state
under the global name of its parameter (``optimizer.state.12.weight.exp_avg``). A checkpoint saved
with K stages, in one process or under torchrun, therefore loads into a run with another K, or into
the single-process front ends; an optimizer over the new layout's parameters takes the very update
the uninterrupted run would have taken.

Layout of a checkpoint directory::

    ckpt/
      latest                  the name of the newest complete checkpoint
      step-00000100/
        .metadata             DCP's index: every entry's key, dtype and shape, and where its bytes are
        __0_0.distcp          the entries of rank 0 (one data file per writing rank)
        __1_0.distcp
        manifest.json         gpipe's: format, step, number of layers, optimizer class, and every
                              file written with its size and SHA-256; written last
        run.json              files given by ``extra=``, if any (gpipe train: run.json, scheduler.json)

The entries (DCP's keys)::

    model.<layer>.<name>                      tensor: a parameter or buffer of the layer (its state_dict name)
    optimizer.state.<layer>.<param>.<key>     the optimizer's state of parameter <layer>.<param>: a
                                              tensor (``exp_avg``, ``step``...), or another value, pickled
    optimizer.param_groups.<layer>.<param>    the hyper-parameters of that parameter's group (lr, betas...), pickled

Why DCP: it is PyTorch's format for checkpoints of distributed training. Every rank writes its own
entries, in parallel, into a file of its own; rank 0 writes one index of all of them. A reader plans
from that index and reads only the entries it asks for, from the files that hold them: a rank of a
run with 4 stages reads its layers only, whichever of the files of a run with 2 stages hold them.
Other tools read the format (``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` makes
one torch.save file of it). The hyper-parameters are kept per parameter, as in DCP's own flattened
optimizer state dicts: the optimizer's groups are a layout's, a parameter's name is not.

What stays of gpipe's earlier format (one torch.save file per stage, listed by the manifest): the
step folders, ``latest``, the atomic replacement of a folder, and ``manifest.json``, which now names
the format instead of listing files. DCP's ``.metadata`` could carry the same facts, but the manifest
is readable without unpickling anything, and it is written last, after every rank's entries and
extra files are in: it is what makes a folder complete. Folders of the earlier format are not read
(:class:`CheckpointError` says so).

Saving. A save replaces a step's whole folder at once. It builds the new folder under a temporary
sibling name (``.step-00000100.tmp``): rank 0 prepares it, every rank writes its ``extra`` files
there, DCP writes every rank's entries (only the first data-parallel replica's: the others hold
the same tensors, and contribute nothing), then rank 0 writes the manifest, swaps the folder into
place and rewrites ``latest``. The swap exchanges the two folders atomically (Linux
``renameat2(RENAME_EXCHANGE)``); where that is not available, the old folder is first renamed aside
to ``.step-00000100.old``, which :func:`latest` falls back to, and removed once the new folder is in
place. At every instant a crash therefore leaves the previous checkpoint loadable, ``latest`` names
only complete folders, and no file of an earlier save of the same step survives in the new one.
The next save into the directory removes what a killed save left behind (temporary files and
folders); loading never changes the directory, so it is safe while another process saves. Old
checkpoints go only when asked: :func:`prune` deletes the complete ones but the newest N, never the
one ``latest`` names nor a folder a save is still writing (``gpipe train --keep N``); :func:`complete`
lists the complete ones, newest first; :func:`find` is the one a path names (a checkpoint folder, a
folder of them, or a run's folder holding ``checkpoints``: what the commands' ``--checkpoint`` and
``--init`` take).

Asynchronous saves. ``save(..., asynchronous=True)`` copies this rank's entries into CPU memory (so
that training may change the weights and the optimizer state at once: the checkpoint holds them as
they were at the call), writes the ``extra`` files, and returns an :class:`AsyncSave`; a thread of
its own then runs DCP's write and, once every rank's write is complete, the commit (manifest, swap,
``latest``). A checkpoint thus appears in ``latest`` only when it is complete, whether or not anyone
waits for it. ``AsyncSave.wait()`` returns its folder or raises its error; a later save first waits
for the one under way, and raises its error if no one has seen it. The copy costs this rank's state
(model and optimizer) once more in CPU memory: its buffers are kept for the next asynchronous save
of the same pipeline, since copying into memory already mapped is several times faster than into new
memory (98 MiB: 7 ms against 70 ms on a small VM, where a synchronous save took 80 ms). The write
then shares the CPU with training: worth it where the CPU has room to spare (a GPU's host) or the
storage is slow. (``dcp.async_save`` is DCP's thread around ``dcp.save``; gpipe runs ``dcp.save`` in
a thread of its own instead, since the commit must follow the write, and copies first, so that every
rank knows every copy succeeded before any rank starts writing: a rank that failed to copy would
otherwise leave the others waiting in DCP's collectives.)

Under torch.distributed every rank calls :func:`save`; the collectives of a save (DCP's and the
agreement of the ranks before the commit) run over a gloo process group of their own, made at the
first save, so that a write in the background never interleaves with a training step's collectives.
A rank that dies stops the others' save at once (its connections close), one that hangs after
30 minutes. :func:`load` is local: each process reads the entries of its own layers (and of its
optimizer's parameters), with no collective.

Checksums. The manifest lists every file the save wrote (``"files"``: each one's size and SHA-256,
as ``sha256sum`` gives it). Each rank hashes its data file as DCP writes it, in a thread of its own
that trails the writes (no second read; DCP's index too), and the small ``extra`` files once
written; rank 0 gathers them all in the agreement before the commit. :func:`load` checks the files it reads before
it reads them: under torch.distributed, each rank those that hold its own entries (with no
collective: a load stays local). :func:`verify` checks every file of a checkpoint, in one process.
A file of another size or another digest is a :class:`CheckpointError` naming it (``truncated: 1234
of 5678 bytes``, ``corrupt: its sha256 differs from the manifest's``); a checkpoint saved before
checksums lists none, and loads as before. ``gpipe train --resume`` falls back to the newest older
checkpoint that loads, with a warning naming the damaged file.

A full disk raises :class:`NoSpaceError` naming the file, and leaves no partial files; a corrupt or
incomplete checkpoint, or one of another model's shape, raises :class:`CheckpointError` naming the
file (and the layer) and what is wrong; loading checks everything before it changes the model or
the optimizer. DCP's index and the entries that are not tensors are pickles: load checkpoints you
trust, as with ``torch.load(weights_only=False)``.

Part of the library: imports torch and gpipe's library modules (the engine, the runtime, the pipeline
front ends), never the applications (train, data, models, ...).
"""

from gpipe.saving.asynchronous import AsyncSave
from gpipe.saving.checksums import verify
from gpipe.saving.folders import CheckpointError, NoSpaceError, complete, find, latest, prune, write_atomically
from gpipe.saving.keys import layer_state
from gpipe.saving.loader import load
from gpipe.saving.module import load_module
from gpipe.saving.saver import save

__all__ = [
    "AsyncSave",
    "CheckpointError",
    "NoSpaceError",
    "complete",
    "find",
    "latest",
    "layer_state",
    "load",
    "load_module",
    "prune",
    "save",
    "verify",
    "write_atomically",
]
