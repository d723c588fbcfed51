"""framekv.engine.serving: streams served from one pool.

``stream.py`` the record of one stream (`Stream`, its `Phase`); ``delivery.py`` its
chunks on their way to its client, whatever carries them (`Delivery`, `Handout`,
`end_message`, and the scheduler's `Deliveries`: handout, ack, rewind);
``scheduler.py`` the scheduler that steps them (`StreamScheduler`), ``loop.py`` the
thread that steps it, ``steps.py`` its plan, run and commit; ``slots.py`` the slots and
which stream gives one up; ``sizes.py`` how many streams, slots, batch sizes and scratch
rows; ``state_files.py`` a stream as one `StreamState` and folders of them;
``checkpoint.py`` streams written as they go; ``records.py`` the chunks, prompt changes
and counters handed out; ``moves.py`` whole streams in and out; ``turns.py`` which
streams a step runs; ``step_record.py`` a step as it passes plan, run and commit, and
its decode beside the next step's transformer (`Overlap`); ``preview.py`` a picture of latents for a model without a VAE; ``intake.py`` a video
stream's frames waiting for their chunk (`Intake`: the bound, the drops) and
``video_in.py`` the scheduler's video streams (`feed`, the encoder's half of a step,
`framekv.engine.encode_stage`). Decoding itself, the
uint8 frames included, is the engine's (`framekv.engine.decode_stage`,
`framekv.engine.decode_lane`). The step contract between the scheduler
and the runner is `framekv.engine.step`; the chunk message `framekv.specs.wire`.
"""
from ..decode_lane import to_uint8
from .checkpoint import Checkpoints
from .delivery import Delivery, Handout, check_after, end_message
from .preview import LatentPreview
from .records import (LATENCY_BUCKETS, EndedSessions, Histogram, PromptChange, PromptTooLate,
                      SessionChunk)
from .scheduler import LoopStopped, SchedulerFull, StreamScheduler
from .sizes import default_batch_sizes
from .slots import SlotPool, pick_victim
from .stream import Phase, Stream

__all__ = ["Checkpoints", "Delivery", "EndedSessions", "Handout", "Histogram",
           "LATENCY_BUCKETS", "LatentPreview", "LoopStopped", "Phase", "PromptChange",
           "PromptTooLate", "SchedulerFull", "SessionChunk", "SlotPool", "Stream",
           "StreamScheduler", "check_after", "default_batch_sizes", "end_message",
           "pick_victim", "to_uint8"]
