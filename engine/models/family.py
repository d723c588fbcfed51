"""`ModelFamily`: what one kind of model gives the commands, and `LoadedModel`: one of
its models, loaded.

A family says what it is before anything is built: its shipped ``configs`` (random
weights of a named shape), the preset it runs at by default, the model options it
takes (`MODEL_OPTIONS`: a checkpoint, a sampler, a decoder, ...), its decoders and
encoders by kind. `ModelFamily.check` refuses a bad option of its own before any weight
is read; `ModelFamily.load` reads or builds the model (weights, text encoder, VAE) and
returns a `LoadedModel`, from which a command builds what it runs:

    model = family.load(ModelOptions(config="tiny"), device="cpu")
    runner = model.rollout(use_graphs=False)       # a ChunkRunner over its chunk model
    sched = StreamScheduler(**model.scheduler_args(), decoder_factory=model.decoder)

``decoder(kind, path, ...)`` and ``encoder(kind, path, ...)`` build a family's streaming
coders by kind (a `LoadedModel` builds those of its decoder choice); a family without a
video decoder shows its latents as pictures (`LatentPreview`, kind ``"preview"``), and
one without an encoder says so (a ValueError).
"""
from __future__ import annotations

import abc
import dataclasses

__all__ = ["MODEL_OPTIONS", "PREVIEW", "LoadedModel", "ModelFamily", "ModelOptions", "spelled"]

#: The model options a family may take (`ModelOptions` fields beyond the preset), in the
#: order messages list them.
MODEL_OPTIONS = ("config", "weights", "checkpoint", "sampler", "sampler_options", "shift",
                 "steps", "decoder", "kv_dtype", "gemm_dtype")
#: The decoder kind of a family without a video decoder: pictures of its latents.
PREVIEW = "preview"


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """What a command asks of a model; None is "not given" (the family's default).

    Attributes:
        preset: the sizes (a shipped preset's name or a preset file's path, or a
            `Preset`); None: the family's default.
        config: a shipped config of the family (random weights).
        weights: a local folder of the family's weights.
        checkpoint: a checkpoint file replacing the model's weights.
        sampler, sampler_options, shift: the sampler (`framekv.engine.samplers`), its
            options (a mapping) and the timestep shift of its schedule.
        steps: N of the preset's denoising steps (`pick_steps`).
        decoder: the decoder choice (the family's syntax, e.g. ``tiny:PATH``).
        kv_dtype, gemm_dtype: the K/V pool and the blocks' GEMMs ("fp8"; None the
            model's dtype).
    """

    preset: object = None
    config: str | None = None
    weights: str | None = None
    checkpoint: str | None = None
    sampler: str | None = None
    sampler_options: object = None
    shift: float | None = None
    steps: int | None = None
    decoder: str | None = None
    kv_dtype: str | None = None
    gemm_dtype: str | None = None

    def given(self) -> tuple[str, ...]:
        """The model options given (not None), in `MODEL_OPTIONS` order."""
        return tuple(name for name in MODEL_OPTIONS if getattr(self, name) is not None)


def spelled(names, option: str) -> str:
    """How ``names`` (a mapping of option to what a caller calls it, or None) spells
    ``option`` in a message: the command line's flags, or the keyword itself."""
    return option if names is None else names.get(option, option)


#: what a family naming `encoders` defines itself (`ModelFamily.__init_subclass__`)
_VIDEO_METHODS = ("encoder", "video_chunks", "video_options")


class ModelFamily(abc.ABC):
    """One kind of model (module doc); a family overrides what it has. The registry
    (`framekv.engine.models.register_model`) names it: ``name``.

    Attributes:
        name: its registered name (a ``--model`` value).
        title: what it is, in a phrase (help texts).
        configs: the shipped configs a ``config`` may name (none: ()).
        default_config: the config used when neither config nor weights is given.
        default_preset: the preset used when none is given, or None when the default
            follows the model (a config's own preset, say: `check` cannot know it).
        options: the `MODEL_OPTIONS` it takes; any other given is refused
            (`framekv.engine.models.check_model`).
        decoders, encoders: the kinds of streaming decoder and encoder it builds.
    """

    name: str = ""
    title: str = ""
    configs: tuple[str, ...] = ()
    default_config: str | None = None
    default_preset: str | None = None
    options: frozenset[str] = frozenset()
    decoders: tuple[str, ...] = (PREVIEW,)
    encoders: tuple[str, ...] = ()

    def check(self, options: ModelOptions, names=None) -> None:
        """A ValueError for an option of its own that cannot work (a config it does not
        ship, a decoder file that is not there), before anything is read or built;
        ``names`` spells the options in the message (`spelled`)."""
        if options.config is not None and options.config not in self.configs:
            raise ValueError(f"{spelled(names, 'config')} must be one of "
                             f"{list(self.configs)}, got {options.config!r}")

    @abc.abstractmethod
    def load(self, options: ModelOptions, *, device=None, text_encoder: bool | None = None,
             decode: bool = True) -> "LoadedModel":
        """The model of ``options`` on ``device``: weights read or built, with its text
        encoder (``text_encoder`` True: one is needed, a ValueError without; None:
        where it has one; False: none) and, with ``decode``, what its decoder needs.
        A ValueError names a bad option before any weight is read."""

    def label(self, options: ModelOptions) -> str:
        """The model's name where a server shows it (/v1/info): ``NAME:WHICH``, WHICH
        its config, else its preset."""
        preset = options.preset or self.default_preset
        which = options.config or getattr(preset, "name", preset) or self.default_config
        return f"{self.name}:{which or ''}"

    def decoder(self, kind: str, path=None, *, model: "LoadedModel", sequences=None,
                use_graphs: bool | None = None):
        """The streaming decoder of kind ``kind`` (one of `decoders`; ``path`` its
        weights, None: the model's own) for ``model``, ``sequences`` rows (default 1).
        Here: `LatentPreview`, pictures of the latents."""
        from ..serving.preview import LatentPreview

        self._check_kind("decoder", kind, self.decoders)
        return LatentPreview(sequences or 1)

    def encoder(self, kind: str, path=None, *, model: "LoadedModel", sequences=None,
                use_graphs: bool | None = None):
        """The streaming encoder of kind ``kind`` (frames in, latents out), following the
        decoder of that kind; here (a family without `encoders`) a ValueError."""
        self._check_kind("encoder", kind, self.encoders)

    def decoder_title(self, kind: str, path=None) -> str:
        """The decoder of a choice, in a phrase (a command's header)."""
        return "latent previews (no video decoder)"

    def encoder_title(self, kind: str, path=None) -> str:
        """The encoder that follows a decoder choice, in a phrase (a command's header)."""
        return "no encoder"

    def video_chunks(self, options: ModelOptions) -> tuple[int, tuple[int, int]]:
        """``(F, (H, W))``: the latent frames of a chunk of the model of ``options`` and
        the video size (H, W) its encoder takes, before anything is built (a video input
        is read as chunks of 1 + 4 (F - 1), then 4 F frames of that size). A ValueError
        for a family without an encoder (here) or an option naming no model."""
        raise self._no_video()

    def video_options(self, options: ModelOptions, strength: float) -> ModelOptions:
        """``options`` for a video input at ``strength`` in (0, 1]: the video-to-video
        sampler (`framekv.engine.samplers.VideoToVideoSampler`) over the sampler and
        steps ``options`` run, checked over their schedule before anything is built. A
        ValueError for a family without an encoder, a sampler that cannot be the mode's
        base, or a strength that runs none of the steps (here: no encoder)."""
        raise self._no_video()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        missing = [m for m in _VIDEO_METHODS
                   if cls.encoders and getattr(cls, m) is getattr(ModelFamily, m)]
        if missing:
            raise TypeError(f"{cls.__name__} names encoders {cls.encoders}: it must define "
                            f"{', '.join(missing)}")

    def _no_video(self) -> ValueError:
        return ValueError(f"a video input needs a model family with an encoder (frames "
                          f"in); the {self.name} model family has none")

    def _check_kind(self, part: str, kind, kinds: tuple[str, ...]) -> None:
        if not kinds:
            raise ValueError(f"the {self.name} model family has no {part} (a video input "
                             f"needs a family with one), got {part} {kind!r}")
        if kind not in kinds:
            raise ValueError(f"{part} must be one of {list(kinds)} for the {self.name} "
                             f"model family, got {kind!r}")


class LoadedModel(abc.ABC):
    """A family's model as `ModelFamily.load` made it: what a command builds its runners
    and coders from.

    Attributes:
        family, options: whose model, asked how.
        device: where it runs.
        text_encoder: the text encoder for text prompts, or None.
        decoder_choice: ``(kind, path)`` of the decoder `decoder` builds.
        title: what it is, in a phrase (a command's header).
        cache_dir, use_graphs, backend: how a call builds its runner (a scheduler's
            ``runner_factory``).
    """

    def __init__(self, family: ModelFamily, options: ModelOptions, *, device,
                 text_encoder=None, decoder_choice=(PREVIEW, None), title: str = ""):
        self.family, self.options, self.device = family, options, device
        self.text_encoder, self.decoder_choice = text_encoder, tuple(decoder_choice)
        self.title = title or family.label(options)
        self.cache_dir: str | None = None
        self.use_graphs = True
        self.backend = None

    @abc.abstractmethod
    def rollout(self, **kwargs):
        """A `ChunkRunner` over the model's chunk model at its sizes and sampling, with
        ``options``' pool and GEMM dtypes; ``kwargs`` (``sequences``, ``batch_sizes``,
        ``use_graphs``, ``backend``, ``cache_dir``, ...) add to or replace them."""

    def __call__(self, *, sequences: int, batch_sizes):
        """The runner of ``sequences`` sequences and ``batch_sizes`` (a scheduler's
        ``runner_factory``), built with `cache_dir`, `use_graphs` and `backend`."""
        return self.rollout(sequences=sequences, batch_sizes=batch_sizes,
                            cache_dir=self.cache_dir, use_graphs=self.use_graphs,
                            backend=self.backend)

    def decoder(self, rows: int | None = None, *, use_graphs: bool | None = None):
        """The streaming decoder of `decoder_choice`, ``rows`` rows (default 1; a
        scheduler's ``decoder_factory`` is called with its slots)."""
        kind, path = self.decoder_choice
        return self.family.decoder(kind, path, model=self, sequences=rows,
                                   use_graphs=use_graphs)

    def encoder(self, rows: int | None = None, *, use_graphs: bool | None = None):
        """The streaming encoder that follows `decoder_choice` (`ModelFamily.encoder`)."""
        kind, path = self.decoder_choice
        return self.family.encoder(kind, path, model=self, sequences=rows,
                                   use_graphs=use_graphs)

    @property
    def decoder_title(self) -> str:
        """The decoder of `decoder_choice`, in a phrase."""
        return self.family.decoder_title(*self.decoder_choice)

    @property
    def encoder_title(self) -> str:
        """The encoder that follows `decoder_choice` (`encoder`), in a phrase."""
        return self.family.encoder_title(*self.decoder_choice)

    def scheduler_args(self) -> dict:
        """`StreamScheduler` keyword arguments that make its runner this model's: here
        the model as its ``runner_factory``."""
        return {"runner_factory": self}
