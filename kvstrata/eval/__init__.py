"""The accuracy lab: perplexity drift, KL, sensitivity, precision plans."""
