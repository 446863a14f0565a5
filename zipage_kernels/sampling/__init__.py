"""The draw of next tokens on the device: `triton_sampling.sample_rows`, the Triton version of
`reference.sample_rows` (a sampled row's temperature, top-k, top-p and min-p, and its inverse-CDF
draw), registered behind the seam like every other kernel."""
