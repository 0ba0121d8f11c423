"""The model a point decodes with: its description (model_args.py, over the presets' table in presets.py) and
where it comes from (resolve.py), the Llama-family decoder (model.py) with multi-head latent attention (mla.py),
and the named, timed phases of generation (decode.py: prefill, decode_step, generate)."""
