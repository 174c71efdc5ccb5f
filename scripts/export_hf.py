"""Write a run's exported GPT (model=gpt) as a Hugging Face GPT-2 folder, with its tokenizer.

    python scripts/export_hf.py outputs/RUN/model outputs/RUN/model_hf

transformers (AutoModelForCausalLM / AutoTokenizer.from_pretrained), lm-evaluation-harness and vLLM read the
folder, and so does the template: model=hf_causal_lm model.pretrained=outputs/RUN/model_hf fine-tunes it. The
folder is written only once transformers gives the export's logits and token ids (src/models/to_transformers.py).
A transformers model's export (model=hf_causal_lm) is such a folder already.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: src/

from src.errors import UsageError  # noqa: E402
from src.models.to_transformers import export_to_transformers  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="an export folder: outputs/RUN/model (or model_best, model_ema)")
    parser.add_argument("target", type=Path, help="the GPT-2 folder to write (must not exist)")
    args = parser.parse_args()
    try:
        difference = export_to_transformers(args.source, args.target)
    except (UsageError, FileNotFoundError) as error:
        sys.exit(f"error: {error}")
    print(f"wrote {args.target}: transformers' GPT-2 gives the export's logits (largest difference "
          f"{difference:.2g}) and its tokenizer the export's ids")


if __name__ == "__main__":
    main()
