"""Model definitions: shared layers (layers.py, attention.py, moe.py), the blocks and the decoder every family builds
(blocks.py, model.py), one short file per family saying what differs, model_type -> Family (family.py), the
quantization facts per family (registry.py), checkpoint names (keys.py), ModelConfig (config.py), the loader
(loader.py), and vision-language checkpoints (Gemma 3, Mistral 3, LLaVA) read as their text decoder (multimodal.py).

The family files are imported here (below), so each registers its Family before any model is built.
"""

from quantkit.models.attention import AttentionSpec, unsupported_by_paged_attention  # noqa: F401
from quantkit.models.arcee import ARCEE  # noqa: F401
from quantkit.models.config import ModelConfig  # noqa: F401
from quantkit.models.cohere import COHERE, COHERE2  # noqa: F401
from quantkit.models.ernie4_5 import ERNIE4_5  # noqa: F401
from quantkit.models.ernie4_5_moe import ERNIE4_5_MOE  # noqa: F401
from quantkit.models.exaone4 import EXAONE4  # noqa: F401
from quantkit.models.gemma import GEMMA  # noqa: F401
from quantkit.models.gemma2 import GEMMA2  # noqa: F401
from quantkit.models.gemma3 import GEMMA3  # noqa: F401
from quantkit.models.glm import GLM, GLM4  # noqa: F401
from quantkit.models.glm4_moe import GLM4_MOE  # noqa: F401
from quantkit.models.granite import GRANITE  # noqa: F401
from quantkit.models.helium import HELIUM  # noqa: F401
from quantkit.models.hunyuan import HUNYUAN  # noqa: F401
from quantkit.models.hunyuan_moe import HUNYUAN_MOE  # noqa: F401
from quantkit.models.llama import LLAMA  # noqa: F401
from quantkit.models.ministral import MINISTRAL  # noqa: F401
from quantkit.models.ministral3 import MINISTRAL3  # noqa: F401
from quantkit.models.mistral import MISTRAL  # noqa: F401
from quantkit.models.mixtral import MIXTRAL  # noqa: F401
from quantkit.models.model import CausalLM  # noqa: F401
from quantkit.models.nemotron import NEMOTRON  # noqa: F401
from quantkit.models.olmo2 import OLMO2  # noqa: F401
from quantkit.models.olmo3 import OLMO3  # noqa: F401
from quantkit.models.olmoe import OLMOE  # noqa: F401
from quantkit.models.phi3 import PHI3  # noqa: F401
from quantkit.models.qwen2 import QWEN2  # noqa: F401
from quantkit.models.qwen2_moe import QWEN2_MOE  # noqa: F401
from quantkit.models.qwen3 import QWEN3  # noqa: F401
from quantkit.models.qwen3_moe import QWEN3_MOE  # noqa: F401
from quantkit.models.seed_oss import SEED_OSS  # noqa: F401
from quantkit.models.smollm3 import SMOLLM3  # noqa: F401
from quantkit.models.starcoder2 import STARCODER2  # noqa: F401
