"""Visual tokens: saliency from the vision tower's attention and affinity-aware compression (VisMMOE
Algorithm 1). Pure tensor code: imports nothing else of the package."""
