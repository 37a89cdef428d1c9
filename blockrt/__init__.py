"""blockrt's top level, above the three packages it ships (`backends`, `allocators`,
`runtime`): the command line (`blockrt.cli`, the `blockrt` console script, `python -m blockrt`)
and the example model configurations it shares with the benchmarks (`blockrt.models`). Both
use the runtime only through its public API.
"""
