"""`relay run --devices`: one worker process per device, one writer in the parent.

`devices.py` reads the device list, `codec.py` is the JSON messages between the
processes, `worker.py` is a worker's process, `pool.py` deals rows to the workers and
collects their answers, `job.py` is the job around them (the same checks, writer and
resume as relaycli.job).
"""
