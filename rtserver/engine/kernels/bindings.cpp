// The kernel's Python module: what the engine calls (quant.py's load_kernel builds it once per CPU).
// The code lives by concern: blocks.h (each GGUF block type's decoder), matmul.h (the linears on
// their blocks), panel.h, int_panel.h and byte_panel.h (many-row steps), byte_dots.h (AVX2's 8-bit
// activations), attention.h (attention over the paged KV pool), vmath.h (dot products, exp, tanh),
// layer.h (a whole decoder layer in one call), pool.h (the worker threads every loop runs on).
#include <torch/extension.h>

#include "attention.h"
#include "layer.h"
#include "matmul.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every function lets go of the GIL while it runs: the model runs on the scheduler thread, and a
  // fused step holding the GIL through its layers kept the event loop (the hub) waiting.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("q4_1_mm", &q4_1_mm, "x [M, K] float32 @ Q4_1 blocks [N, K].T -> [M, N] float32", nogil);
  m.def("q8_0_mm", &q8_0_mm, "x [M, K] float32 @ Q8_0 blocks [N, K].T -> [M, N] float32", nogil);
  m.def("blocks_mm", &blocks_mm, "x [M, K] float32 @ a stacked block weight (parts side by side) -> [M, N]",
        py::arg("x"), py::arg("formats"), py::arg("a"), py::arg("b"), py::arg("panels") = Tensors{}, nogil);
  m.def("unpack_panels", &unpack_panels, "a block weight's panels for many-row steps, unpacked once", nogil);
  m.def("panels_of", &panels_of, "a weight as a panel format alone, read at every step size", nogil);
  m.def("kept_bytes", &kept_bytes, "the bytes unpack_panels takes for a weight of this format and shape");
  m.def("set_panel_rows", &set_panel_rows, "steps of more rows than this run on panels of weight rows");
#ifdef RTSERVER_INT_DOTS
  m.def("set_activation_bits", [](int bits) {
    TORCH_CHECK(bits == 8 || bits == 16, "big steps' activations are 8 or 16 bits, not ", bits);
    int_panel::g_activation_bits = bits;
  }, "big steps round activations to this many bits from now on; panels made before stay in their own");
  m.def("activation_bits", [] { return int_panel::g_activation_bits; }, "the bits big steps round activations to");
#else
  m.def("set_activation_bits", [](int bits) {
    TORCH_CHECK(bits == 8 || bits == 16, "big steps' activations are 8 or 16 bits, not ", bits);
    panel::g_activation_bits = bits;
  }, "8: big steps on byte dots (AVX2); 16: in float32, nothing rounded");
  m.def("activation_bits", [] {
#ifdef RTSERVER_BYTE_DOTS
    if (panel::g_activation_bits == 8) return 8;
#endif
    return 32;
  }, "the bits big steps round activations to (32: float32, not rounded)");
#endif
  m.def("bind_pool", [](int threads) { pool::Pool::get().bind(threads); },
        "the calling thread owns the kernel's worker threads from now on, `threads` in all", nogil);
  m.def("pool_stats", [] {
    const auto& p = pool::Pool::get();
    return py::dict(py::arg("threads") = p.threads(), py::arg("loops") = p.loops(), py::arg("off_owner") = p.off_owner());
  }, "the pool's threads, its parallel loops so far, and loops started off its owner's thread (run alone)");
  m.def("pool_probe", [](int64_t items, int64_t stall_us) {
    // One loop whose first chunk on a worker stalls, as a worker that lost its core: who ran the rest.
    // The owner waits (up to five seconds) for a worker to have begun, so that the stall happens.
    const auto owner = std::this_thread::get_id();
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    std::atomic<int64_t> by_owner{0}, by_workers{0};
    std::atomic<bool> stalled{false};
    pool::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
      const bool mine = std::this_thread::get_id() == owner;
      if (mine) {
        while (!stalled.load() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
      } else if (!stalled.exchange(true)) {
        std::this_thread::sleep_for(std::chrono::microseconds(stall_us));
      }
      (mine ? by_owner : by_workers).fetch_add(i1 - i0);
    });
    return std::map<std::string, int64_t>{{"owner", by_owner.load()}, {"workers", by_workers.load()}};
  }, "a loop of `items` whose first worker chunk stalls `stall_us`: the items the owner and the workers ran", nogil);
  m.def("dequantize_blocks", &dequantize_blocks, "raw GGUF blocks [N, row bytes] of width K -> float32 [N, K]", nogil);
  m.def("decode_attention", &decode_attention, "single-token attention over paged K/V (float32, bfloat16, float16 or q8_0)", nogil);
  m.def("prefill_attention", &prefill_attention, "causal attention of prompt rows over paged K/V (float32, bfloat16, float16 or q8_0)", nogil);
  m.def("move_rows", &move_rows, "pool rows copied to other slots, keys rotated (RoPE) per row", nogil);
  m.def("quantize_kv", &quantize_kv, "float32 rows [..., D] -> q8_0 pool rows uint8 [..., D / 32 * 34]", nogil);
#ifdef RTSERVER_BYTE_DOTS
  m.attr("byte_dots") = true;  // AVX2 alone: 8-bit activations take every step to byte dots
#else
  m.attr("byte_dots") = false;
#endif
#ifdef RTSERVER_INT_DOTS
  m.attr("fixed_point_activations") = true;
  m.attr("decode_passes") = kquant::pass_types();  // block types decoded by passes of their own
#elif defined(RTSERVER_AVX2_DOTS)
  m.attr("fixed_point_activations") = false;  // only the decode passes round: the rest runs in float
  m.attr("decode_passes") = kquant::pass_types();
#else
  m.attr("fixed_point_activations") = false;
  m.attr("decode_passes") = std::vector<std::string>{};
#endif
  py::class_<FusedLayer>(m, "FusedLayer", py::module_local(), "one decoder layer's weights and switches, checked once")
      .def(py::init<const Tensor&, const Formats&, const Tensors&, const Tensors&, const Tensors&,
                    const c10::optional<Tensor>&, const Formats&, const Tensors&, const Tensors&, const Tensors&,
                    const Tensor&, const Formats&, const Tensors&, const Tensors&, const Tensors&, const Formats&,
                    const Tensors&, const Tensors&, const Tensors&, int64_t, int64_t, int64_t, double, double,
                    const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool>());
  m.def("layer_forward", &layer_forward, "one decoder layer for a step's rows on quantized blocks (keep: rows going on)",
        py::arg("layer"), py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("k_pool"), py::arg("v_pool"),
        py::arg("write_slots"), py::arg("table"), py::arg("item"), py::arg("position"), py::arg("window"),
        py::arg("keep") = py::none(), nogil);
  m.def("release_scratch", &release_scratch, "frees this thread's layer_forward buffers");
}
