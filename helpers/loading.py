"""``python -m helpers.loading PRESET DIR``: write a pretrained checkpoint to DIR (the code: helpers.job.loading)."""

import sys

if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m helpers.loading PRESET DIR   (writes a pretrained checkpoint to DIR)")
    from helpers import set_ds_accelerator

    set_ds_accelerator()  # transformers imports DeepSpeed when it is installed
    from helpers.job.loading import save_preset

    save_preset(sys.argv[1], sys.argv[2])
    print(f"wrote {sys.argv[2]} ({sys.argv[1]}, fp32 safetensors)")
