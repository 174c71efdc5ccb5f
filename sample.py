"""Sample text from an exported language model: a run's `model/` (or `model_best/`, `model_ema/`) folder, or a
pretrained model by its Hugging Face hub id (fetched into the Hugging Face cache: src/models/hub.py).

    python sample.py outputs/RUN/model --prompt "ROMEO:"
    python sample.py gpt2 --prompt "Hello," --tokens 40                     # a base model, before fine-tuning it
    python sample.py outputs/RUN/model --prompt "To be" --num-samples 3 --tokens 100 --temperature 0.9 --seed 7

The folder holds the weights, the model's config and how the run's text became token ids (vocabulary.json or
tokenizer.json): no training data, no Hydra config. The same folder, prompt and seed give the same text.
(Plain argparse, not Hydra: the folder is the whole configuration.)
"""

import argparse
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from src.checkpointing.export import load_exported_model
from src.data.tokenizer import Codec
from src.errors import UsageError
from src.loop.sampling import sample_texts
from src.models.hf_causal_lm import output_width, positions_of
from src.models.hub import local_path


def block_size_of(model: torch.nn.Module, folder: Path) -> int:
    """The longest sequence the model was trained on (its config.yaml), else what its positions allow."""
    if (folder / "config.yaml").is_file():
        size = OmegaConf.load(folder / "config.yaml").get("block_size")
        if size:
            return int(size)
    return positions_of(getattr(model, "config", None)) or 1024


def check_it_writes(model: torch.nn.Module, folder: str) -> None:
    """A reward model (objective=reward's export) gives one value per position, not a distribution over the next
    token: sampling from it would write token 0 again and again."""
    if output_width(model) == 1:
        raise UsageError(f"{folder}: a reward model (one value per position, objective=reward's export) scores text, "
                         f"it does not write it: score with python eval.py path={folder}, or sample from a language "
                         "model's export")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="an exported model folder (e.g. outputs/RUN/model) or a hub model id")
    parser.add_argument("--prompt", default="\n", help="text to continue (default: a new line)")
    parser.add_argument("--num-samples", type=int, default=1, help="continuations of the prompt")
    parser.add_argument("--tokens", type=int, default=200, help="tokens sampled after the prompt")
    parser.add_argument("--temperature", type=float, default=0.8, help="softmax temperature (lower: safer)")
    parser.add_argument("--top-k", type=int, default=200, help="sample from the k likeliest tokens (0: all)")
    parser.add_argument("--seed", type=int, default=1337, help="the sampler's seed")
    parser.add_argument("--trust-target", action="append", default=[], metavar="CALLABLE",
                        help="a _target_ of the folder's config.yaml that config/ does not offer, trusted to be "
                             "built (its config is data: nothing else it names is called)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.num_samples < 1 or args.temperature <= 0 or args.top_k < 0:
        parser.error("--tokens and --num-samples must be >= 1, --temperature > 0, --top-k >= 0")
    try:
        import transformers

        transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars would precede the text
    except ImportError:
        pass
    try:
        folder = local_path(args.folder, "folder", refresh=True)  # a hub id: its snapshot in the HF cache
        codec = Codec.load(folder)
        model = load_exported_model(folder, args.device, args.trust_target, accept="--trust-target {value}")
        check_it_writes(model, args.folder)
        texts = sample_texts(model, codec, [args.prompt] * args.num_samples, args.tokens, args.temperature,
                             args.top_k or None, args.seed, block_size_of(model, folder))
    except (UsageError, FileNotFoundError) as error:
        print(f"sample.py: {error}", file=sys.stderr)
        return 2
    for i, text in enumerate(texts):
        if args.num_samples > 1:
            print(f"--- sample {i}")
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
