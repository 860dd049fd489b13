"""fledge: train EAGLE-3 draft heads for speculative decoding, and prove what they are worth.

The repository's top-level folders are this package's subpackages (see docs/design.md, "Layout"):

    fledge.core     errors, atomic files and process groups: what every layer below the stages shares
    fledge.models   the verifier, its hidden-state capture, the EAGLE-3 draft, sampling, the serving format
    fledge.decode   decoding written once: the verifier session, the plain/chain/tree loop, acceptance, drafters
    fledge.data     sources, chat template and loss masks, regeneration, draft vocabulary, the hidden-state cache
    fledge.train    the training loop, the TTT unroll, engines, checkpoints
    fledge.eval     measuring decoders: acceptance metrics, reports, the tuner, the exactness check, sweep tables
    fledge.export   serving checkpoints for vLLM, SGLang and the official EAGLE code, and their checker
    fledge.plan     what a job will cost before it runs: memory, GPU jobs (``fledge plan``), the time budget
    fledge.launch   the ``fledge`` command and the launcher scripts

Imports run one way, down this list (launch above all; plan above train and eval; export and eval beside train):
nothing here imports a layer above itself.
"""

__version__ = "0.1.0"
