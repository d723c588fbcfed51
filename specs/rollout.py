"""One autoregressive rollout: chunks of frames over a pinned prompt and a sliding window."""
from __future__ import annotations

import msgspec

from .checks import check_int
from .geometry import Geometry


class RolloutSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a rollout walks the cache.

    Each chunk runs ``denoising_steps`` forwards that treat the whole chunk as one
    causal block (its frames see each other), then one clean forward cut into
    one-frame blocks whose K/V are committed as history.

    Attributes:
        tokens_per_frame: tokens one latent frame becomes.
        frames_per_chunk: latent frames generated together.
        window_frames: finished frames a chunk sees besides the prompt.
        prompt_tokens: pinned prefix length, visible to every token.
        denoising_steps: denoising forwards per chunk.
        chunks: chunks in the rollout, the last one included.
        last_chunk_frames: frames of the last chunk when it is shorter than the
            others, in [1, frames_per_chunk); 0 when every chunk is full.
    """

    tokens_per_frame: int
    frames_per_chunk: int
    window_frames: int
    prompt_tokens: int
    denoising_steps: int
    chunks: int
    last_chunk_frames: int = 0

    def __post_init__(self) -> None:
        check_int("RolloutSpec", "tokens_per_frame", self.tokens_per_frame, minimum=1)
        check_int("RolloutSpec", "frames_per_chunk", self.frames_per_chunk, minimum=1)
        check_int("RolloutSpec", "window_frames", self.window_frames, minimum=0)
        check_int("RolloutSpec", "prompt_tokens", self.prompt_tokens, minimum=0)
        check_int("RolloutSpec", "denoising_steps", self.denoising_steps, minimum=1)
        check_int("RolloutSpec", "chunks", self.chunks, minimum=1)
        check_int("RolloutSpec", "last_chunk_frames", self.last_chunk_frames, minimum=0,
                  maximum=self.frames_per_chunk - 1)
        if self.last_chunk_frames and self.chunks == 1:
            # A lone short chunk is just a smaller frames_per_chunk; one spelling only.
            raise ValueError(
                "RolloutSpec.last_chunk_frames must be 0 when chunks is 1 "
                f"(set frames_per_chunk instead), got {self.last_chunk_frames}")

    @property
    def chunk_tokens(self) -> int:
        """Query tokens of one full chunk."""
        return self.frames_per_chunk * self.tokens_per_frame

    @property
    def last_chunk_tokens(self) -> int:
        """Query tokens of the last chunk."""
        return (self.last_chunk_frames or self.frames_per_chunk) * self.tokens_per_frame

    @property
    def window_tokens(self) -> int:
        """Tokens of finished frames a block sees besides the prompt."""
        return self.window_frames * self.tokens_per_frame

    @property
    def keys_per_forward(self) -> int:
        """Keys a full chunk's denoising forward attends once the window is full."""
        return self.prompt_tokens + self.window_tokens + self.chunk_tokens

    @property
    def total_frames(self) -> int:
        """Latent frames the rollout generates."""
        return (self.chunks - 1) * self.frames_per_chunk + (
            self.last_chunk_frames or self.frames_per_chunk)

    @property
    def total_tokens(self) -> int:
        """Positions the rollout commits after the prompt."""
        return self.total_frames * self.tokens_per_frame

    def chunk_token_counts(self) -> tuple[int, ...]:
        """The distinct query-token counts of the rollout's chunks, largest first."""
        if self.last_chunk_frames:
            return (self.chunk_tokens, self.last_chunk_tokens)
        return (self.last_chunk_tokens,)

    def geometry(self) -> Geometry:
        """The cache geometry: each chunk's length as a denoising block, a frame as a clean block."""
        return Geometry(
            pin_tokens=self.prompt_tokens,
            window_tokens=self.window_tokens,
            max_staged_tokens=self.chunk_tokens,
            causal_block_sizes=(*self.chunk_token_counts(), self.tokens_per_frame),
        )
