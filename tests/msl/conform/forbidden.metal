// Planted violations of what MSL forbids (tools/msl_conform.py, tests/test_msl_conform.py).
// Every line that must be reported carries "EXPECT: <rule> ..."; nothing else in this file may be.
#include <metal_stdlib>
using namespace metal;

namespace std {  // EXPECT: MSL-STD
struct pair_like {
    float a, b;
};
}  // namespace std

float counter = 0.0f;         // EXPECT: MSL-STATIC
constant float kScale = 2.0f;  // fine: program scope, constant address space
thread_local float tls_value;  // EXPECT: MSL-TLS MSL-STATIC

struct Shape {
    virtual float area() const { return 0.0f; }  // EXPECT: MSL-VIRTUAL
};
struct Square : Shape {  // EXPECT: MSL-VIRTUAL
    float side;
};

inline float fact(float x) {
    return x <= 1.0f ? 1.0f : x * fact(x - 1.0f);  // EXPECT: MSL-RECURSION
}

inline float ping(float x);
inline float pong(float x) {
    return x < 0.0f ? x : ping(x - 1.0f);  // EXPECT: MSL-RECURSION
}
inline float ping(float x) {
    return pong(x * 0.5f);
}

// compile-time recursion over distinct instantiations is not recursion: f<3> -> f<2> -> f<1> -> f<0>
template <int N>
inline float unrolled(float x) {
    return unrolled<N - 1>(x) + 1.0f;
}
template <>
inline float unrolled<0>(float x) {
    return x;
}

inline float square(float x) {
    return x * x;
}

inline float apply(float (*f)(float), float x) {  // EXPECT: MSL-FUNCPTR
    return f(x);  // EXPECT: MSL-FUNCPTR
}

kernel void forbidden(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    static float calls = 0.0f;  // EXPECT: MSL-STATIC
    float* heap = new float[4];  // EXPECT: MSL-NEW
    delete[] heap;               // EXPECT: MSL-NEW
    try {                        // EXPECT: MSL-EXCEPTION
        throw 1;                 // EXPECT: MSL-EXCEPTION
    } catch (...) {              // EXPECT: MSL-EXCEPTION
    }
    const bool nothrow = noexcept(square(1.0f));  // EXPECT: MSL-EXCEPTION
    if (i == 0u) {
        goto done;  // EXPECT: MSL-GOTO
    }
    y[i] = fact(3.0f) + ping(2.0f) + unrolled<3>(1.0f) + apply(square, 2.0f) + calls + kScale + counter + tls_value;  // EXPECT: MSL-FUNCPTR
done:
    std::pair_like pl = {1.0f, 2.0f};  // EXPECT: MSL-STD
    y[0] = pl.a + float(nothrow);
}

int main() {  // EXPECT: MSL-MAIN
    return 0;
}
