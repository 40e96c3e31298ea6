"""pdsim: a simulated prefill/decode engine speaking SGLang's and vLLM's HTTP PD protocols."""
