"""The adapter kit: everything an adapter (``adapters/<framework>/``) may use of the core.

Adapters import this package alone (``from stackwise import _kit``), never a core module,
so the core can change inside while the kit's names hold. Each name is one of the core's
or the contract's own, re-exported here; the adapters' shared contract is
:mod:`stackwise._kit.contract`, the leaf matching of conversions :mod:`stackwise._kit.matching`.

The running layer and messages:
  :func:`at_layer`, :func:`current_layer_index`, :func:`block_name`, :func:`stack_name`,
  :func:`refuse_serving` (the core's serving layout is not an adapter's),
  :func:`refuse_unservable` (options without a serving form, for an adapter that serves),
  :func:`stacked_only` (a ``stackwise.Serving`` refused where stacked trees go).
A Stack's options and call:
  :data:`OPTION_NAMES`, :func:`stack_options`, :func:`hold_options`, :func:`check_bool`,
  :func:`check_layer_axis_name`, :class:`CallArgs`, :func:`is_per_layer`.
``Stack.from_layers``:
  :class:`Prebuilt`, :func:`check_built`, :func:`check_built_options`,
  :func:`first_difference`, :func:`same_value`.
Leaves, concrete or abstract:
  :func:`check_depth`, :func:`leaf_shape`, :func:`exact_dtype`, :func:`integer`,
  :func:`layer_number`, :func:`prng_key`, :func:`is_abstract`, :func:`take`,
  :func:`stack_abstract`, :func:`moveaxis`, :func:`named_leaves`, :func:`describe`.
Conversions between a Stack and its loop:
  :func:`stack_exact`, :func:`unstack_exact`, :func:`depth_of`, :func:`find_depth`,
  :func:`pattern_depths`, :func:`layer_names`, :func:`check_n`, :func:`check_distinct`,
  :func:`check_names_count`, :func:`common_prefix`, and :class:`Leaf`, :func:`correspond`,
  :func:`assemble`, :func:`check_given` (one model's leaves matched to another's).
LoRA adapters and quantized weights in the stacked params (:mod:`stackwise._kit.finetune`):
  :func:`run_layer` (a block on one layer's float weights, a batch of adapters under vmap),
  :func:`warn_unrematted`.
A Stack's variables in the serving layout, leaf-wise (:mod:`stackwise._kit.serving`):
  ``_kit.serving.split`` / ``join`` (convert), ``gather`` / ``scatter`` (at the call),
  ``stack_at`` (a module Stack's place in a model), ``moved`` (its old methods refused).
A per-layer function over stacked leaves (the qwix bridges):
  :func:`map_layers`, :func:`map_params`, :func:`holds_qwix`, :func:`qwix_fix`,
  :func:`qwix_dequantized_bytes`, :func:`map_stats` (SRQ statistics, per layer).
"""

from stackwise._core.checks import check_depth as check_depth
from stackwise._core.checks import exact_dtype as exact_dtype
from stackwise._core.checks import integer as integer
from stackwise._core.checks import layer_number as layer_number
from stackwise._core.checks import leaf_shape as leaf_shape
from stackwise._core.checks import prng_key as prng_key
from stackwise._core.convert import check_distinct as check_distinct
from stackwise._core.convert import check_n as check_n
from stackwise._core.convert import check_names_count as check_names_count
from stackwise._core.convert import common_prefix as common_prefix
from stackwise._core.convert import depth_of as depth_of
from stackwise._core.convert import find_depth as find_depth
from stackwise._core.convert import layer_names as layer_names
from stackwise._core.convert import pattern_depths as pattern_depths
from stackwise._core.convert import stack_exact as stack_exact
from stackwise._core.convert import unstack_exact as unstack_exact
from stackwise._core.markers import CallArgs as CallArgs
from stackwise._core.markers import is_per_layer as is_per_layer
from stackwise._core.options import OPTION_NAMES as OPTION_NAMES
from stackwise._core.options import check_bool as check_bool
from stackwise._core.options import check_layer_axis_name as check_layer_axis_name
from stackwise._core.options import stack_options as stack_options
from stackwise._core.served import stacked_only as stacked_only
from stackwise._core.serving import refuse_unservable as refuse_unservable
from stackwise._core.trees import describe as describe
from stackwise._core.trees import is_abstract as is_abstract
from stackwise._core.trees import moveaxis as moveaxis
from stackwise._core.trees import named_leaves as named_leaves
from stackwise._core.trees import stack_abstract as stack_abstract
from stackwise._core.trees import take as take
from stackwise._kit import serving as serving
from stackwise._kit.calibrated import map_stats as map_stats
from stackwise._kit.contract import Prebuilt as Prebuilt
from stackwise._kit.contract import at_layer as at_layer
from stackwise._kit.contract import block_name as block_name
from stackwise._kit.contract import check_built as check_built
from stackwise._kit.contract import check_built_options as check_built_options
from stackwise._kit.contract import current_layer_index as current_layer_index
from stackwise._kit.contract import first_difference as first_difference
from stackwise._kit.contract import hold_options as hold_options
from stackwise._kit.contract import refuse_serving as refuse_serving
from stackwise._kit.contract import same_value as same_value
from stackwise._kit.contract import stack_name as stack_name
from stackwise._kit.finetune import run_layer as run_layer
from stackwise._kit.finetune import warn_unrematted as warn_unrematted
from stackwise._kit.layered import holds_qwix as holds_qwix
from stackwise._kit.layered import map_layers as map_layers
from stackwise._kit.layered import map_params as map_params
from stackwise._kit.layered import qwix_dequantized_bytes as qwix_dequantized_bytes
from stackwise._kit.layered import qwix_fix as qwix_fix
from stackwise._kit.matching import Leaf as Leaf
from stackwise._kit.matching import assemble as assemble
from stackwise._kit.matching import check_given as check_given
from stackwise._kit.matching import correspond as correspond
