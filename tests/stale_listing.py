"""Two ranks that listed a run dir differently (a network filesystem's cached directory entries): rank 1 "saw"
the checkpoint given as argv[2] where rank 0 saw the newest (argv[1]); with argv[3] == "other-config", rank 1's
choice also came with another config. Each rank writes the checkpoint it agreed on into argv[4].rank<i>.

    torchrun --nproc_per_node 2 tests/stale_listing.py NEWEST STALE same-config|other-config OUT
"""

import sys
from pathlib import Path

from accelerate import Accelerator
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from tests/: the repo's src
from src.checkpointing.checkpointer import agreed_resume_point  # noqa: E402

newest, stale, config, out = sys.argv[1:5]
accelerator = Accelerator(cpu=True)
rank = accelerator.process_index
seen = Path(newest) if rank == 0 else (Path(stale) if stale != "none" else None)
cfg = OmegaConf.create({"run": "the same" if rank == 0 or config == "same-config" else "another"})
agreed = agreed_resume_point(accelerator, seen, cfg)
Path(f"{out}.rank{rank}").write_text(str(agreed))
accelerator.wait_for_everyone()
