"""What rank 0 does to choose a token: a request's sampling parameters, logit adjustments and the sampler, and
grammar-constrained decoding."""
