"""The GraphPipe metadata: what the inputs and outputs are, in the clients' own terms.

The descriptions carry the tensor mapping (``docs/graphpipe.md`` says the same at length),
so that ``remote.metadata(url)`` alone is enough to call the server.
"""

from __future__ import annotations

from prismgate import __version__
from prismgate.codecs.graphpipe.config import CONFIG_KEYS
from prismgate.codecs.graphpipe.inputs import PAD_ID
from prismgate.codecs.graphpipe.outputs import DEFAULT_OUTPUTS
from prismgate.codecs.graphpipe.wire import IOSpec, Metadata
from prismgate.core.engine import EngineInfo
from prismgate.schemas.graphpipe.fb.graphpipe_generated import Type

SERVER = "prismgate"


def describe(info: EngineInfo) -> Metadata:
    manifest = info.readouts
    inputs = (
        IOSpec(
            "prompt",
            "Default input. One user chat message per row (UTF-8), shape [batch] or a scalar; rendered with the "
            "model's chat template unless config.chat_template is false.",
            (-1,),
            Type.String,
        ),
        IOSpec(
            "tokens",
            f"Raw token ids, shape [batch, n] or [n], Int64 or Int32 (any integer type is accepted); trailing "
            f"{PAD_ID} entries are padding. Ids must be in [0, {info.vocab_size}).",
            (-1, -1),
            Type.Int64,
        ),
    )
    outputs = [
        IOSpec(
            "text", "Default output. The generated text of each row (UTF-8), stop string excluded.", (-1,), Type.String
        ),
        IOSpec(
            "tokens",
            f"Generated token ids [batch, m], m = the longest row; padded with {PAD_ID}.",
            (-1, -1),
            Type.Int32,
        ),
        IOSpec("lengths", "Generated tokens per row [batch].", (-1,), Type.Int32),
        IOSpec(
            "logprobs",
            "Log-probability of each generated token under the model's raw distribution [batch, m]; padded with NaN.",
            (-1, -1),
            Type.Float32,
        ),
        IOSpec(
            "top_logprob_ids",
            "The k most likely token ids at each generated position [batch, m, k], best first, k = config.logprobs; "
            f"padded with {PAD_ID}. Pairs with top_logprobs.",
            (-1, -1, -1),
            Type.Int32,
        ),
        IOSpec(
            "top_logprobs",
            "Log-probabilities of top_logprob_ids [batch, m, k]; padded with NaN.",
            (-1, -1, -1),
            Type.Float32,
        ),
    ]
    if manifest is not None:
        outputs.append(
            IOSpec(
                "readouts",
                "Concept readouts of each generated token [batch, m, n_layers, n_concepts]: the "
                f"{manifest.layer_convention} projected on unit concept directions; layers "
                f"{list(manifest.layers)} (or config.readout_layers, in that order), concepts "
                f"{list(manifest.concepts)}; padded with NaN.",
                (-1, -1, -1, len(manifest.concepts)),
                Type.Float32,
            )
        )
    if info.features is not None:
        where = f"SAE layers {list(info.features.layers)} (or config.features.layers, in that order)"
        outputs += [
            IOSpec(
                "feature_ids",
                f"Top SAE feature ids of each generated token [batch, m, n_layers, k], largest first: {where}, "
                f"k = config.features.top_k; padded with {PAD_ID}. Pairs with feature_values.",
                (-1, -1, -1, -1),
                Type.Int32,
            ),
            IOSpec(
                "feature_values",
                "Activations of feature_ids [batch, m, n_layers, k]; padded with NaN.",
                (-1, -1, -1, -1),
                Type.Float32,
            ),
            IOSpec(
                "watched_features",
                f"Activations of config.features.ids at each generated token [batch, m, n_layers, n_ids]: {where}; "
                "padded with NaN.",
                (-1, -1, -1, -1),
                Type.Float32,
            ),
        ]
    config = "; ".join(f"{k}: {v}" for k, v in CONFIG_KEYS.items())
    description = (
        f"Language model {info.model_id!r} served by prismgate ({info.engine_name or 'engine'}); context "
        f"{info.max_model_len} tokens. Each row of the batch is one generation. Default input prompt, default "
        f"output {', '.join(DEFAULT_OUTPUTS)}. InferRequest.config is a JSON object: {config}."
    )
    return Metadata(
        name=info.model_id,
        version=__version__,
        server=SERVER,
        description=description,
        inputs=inputs,
        outputs=tuple(outputs),
    )
