"""fledge: train EAGLE-3 draft heads for speculative decoding, and prove what they are worth.

The repository's top-level folders are this package's subpackages (see docs/design.md, "Layout"):

    fledge.core     errors, atomic files and process groups: what every layer below the stages shares
    fledge.models   the verifier, its hidden-state capture, the EAGLE-3 draft, sampling, the serving format
    fledge.data     sources, chat template and loss masks, regeneration, draft vocabulary, the hidden-state cache
    fledge.train    the training loop, the TTT unroll, engines, checkpoints
    fledge.eval     the speculative loops, acceptance metrics, the tuner, the exactness check
    fledge.export   serving checkpoints for vLLM, SGLang and the official EAGLE code, and their checker
    fledge.launch   the ``fledge`` command and the launcher scripts

Imports run one way, down this list (launch above all; export and eval beside each other above train): nothing
here imports a layer above itself.
"""

__version__ = "0.1.0"
