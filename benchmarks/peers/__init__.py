"""memstore side by side with its peers (issue 30): the same state, machine and run for each system.

    python -m benchmarks.peers [--systems memstore,dcp,ml-flashpoint,dlrover] [--states tensors,model]
        [--size 1GiB] [--tensors 64] [--layers 8] [--dim 1024] [--saves 3] [--json docs/bench/peers.json]
        [--docs docs/benchmarks.md]

Each system (one module each, behind :class:`~benchmarks.peers.common.System`) saves the same state from this
process (the trainer), with 2 hosts on 127.0.0.1 and R=2 where the system replicates, and is measured from the call:

* the blocking stall (until the save call returns and the trainer may touch the state again);
* the time until the checkpoint survives the loss of the saving host (its R copies committed, or a durable write);
* the restore in a fresh process (a new python, nothing warmed up), locally and after the saving host is lost;
* the memory held: the trainer's extra RSS, the RSS of every server or agent process, and the shared memory.

The states (:mod:`~benchmarks.peers.states`): ``tensors``, 64 float32 tensors of 1 GiB in all; ``model``, the
transformer and AdamW of ``benchmarks/gpu_capture.py`` in bf16 after one step (hundreds of tensors). A peer that is
not installed, or cannot run here, is reported *unavailable* with the exact reason, never as a failure. The load
average is recorded at the start and the end of the run: the numbers are only as quiet as the machine was.
"""
