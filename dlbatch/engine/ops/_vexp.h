/* exp's polynomial on vectors of floats, shared by _paged_attn.c and _fused.c: included
 * where `vf` is the vector type and F(name) names a function for its width.
 * exp(r) for |r| <= ln2 / 2 (the caller reduces x = n ln2 + r and scales by 2^n): Cephes'
 * expf coefficients, relative error below 2e-7. */
static inline vf F(exp_poly)(vf r) {
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    return p * r * r + r + 1.f;
}
