package api

import (
	"errors"
	"math/bits"
	"strconv"
	"strings"
)

// maxDecimals bounds a Fraction's precision so its numerator fits a uint64.
// No GPU has 10^18 bytes, so finer shares cannot change a resolved MiB.
const maxDecimals = 18

var pow10 = func() [maxDecimals + 1]uint64 {
	var p [maxDecimals + 1]uint64
	p[0] = 1
	for i := 1; i <= maxDecimals; i++ {
		p[i] = p[i-1] * 10
	}
	return p
}()

// Fraction is an exact decimal in [0, 1]: num / 10^scale. Annotations carry
// decimals written by people; keeping them exact (rather than float64)
// makes floor((mem − reserve) × fraction) and comparisons such as
// "limit > request" give the answer the user expects, e.g. 0.3 × 81920 =
// 24576, not 24575.
type Fraction struct {
	num   uint64
	scale uint8
}

var (
	errNotDecimal   = errors.New("not a decimal")
	errAboveOne     = errors.New("above 1")
	errTooPrecise   = errors.New("too many decimal places")
	errEmptyDecimal = errors.New("empty")
)

// ParseFraction parses a plain decimal between 0 and 1 inclusive: digits
// with an optional point ("0.25", ".25", "1", "0"). Exponents, signs,
// units, spaces, NaN and Inf are not decimals here.
func ParseFraction(s string) (Fraction, error) {
	f, _, err := parseFraction(s)
	return f, err
}

// parseFraction also returns the number of decimal places as written, for
// rules about precision ("0.50000" has five).
func parseFraction(s string) (Fraction, int, error) {
	if s == "" {
		return Fraction{}, 0, errEmptyDecimal
	}
	intPart, fracPart, hasPoint := strings.Cut(s, ".")
	if (intPart == "" && fracPart == "") || (hasPoint && fracPart == "") ||
		!allDigits(intPart) || !allDigits(fracPart) {
		return Fraction{}, 0, errNotDecimal
	}
	written := len(fracPart)
	intPart = strings.TrimLeft(intPart, "0")
	fracPart = strings.TrimRight(fracPart, "0")
	switch {
	case intPart == "":
	case intPart == "1" && fracPart == "":
		return Fraction{num: 1}, written, nil
	default:
		return Fraction{}, written, errAboveOne
	}
	if len(fracPart) > maxDecimals {
		return Fraction{}, written, errTooPrecise
	}
	if fracPart == "" {
		return Fraction{}, written, nil
	}
	n, err := strconv.ParseUint(fracPart, 10, 64)
	if err != nil { // unreachable: at most 18 digits
		return Fraction{}, written, errNotDecimal
	}
	return Fraction{num: n, scale: uint8(len(fracPart))}, written, nil
}

func allDigits(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}

// Thousandths returns n/1000 in its shortest form (250 → 0.25), clamped
// to [0, 1]: the scheduler's ledgers count compute in thousandths.
func Thousandths(n int64) Fraction {
	n = min(max(n, 0), 1000)
	f := Fraction{num: uint64(n), scale: 3}
	for f.scale > 0 && f.num%10 == 0 {
		f.num, f.scale = f.num/10, f.scale-1
	}
	return f
}

// IsZero reports whether f is 0 (also the zero value: no fraction).
func (f Fraction) IsZero() bool { return f.num == 0 }

// IsOne reports whether f is exactly 1.
func (f Fraction) IsOne() bool { return f.num == pow10[f.scale] }

// Cmp returns -1, 0 or +1 as f is less than, equal to or greater than g.
func (f Fraction) Cmp(g Fraction) int {
	ah, al := bits.Mul64(f.num, pow10[g.scale])
	bh, bl := bits.Mul64(g.num, pow10[f.scale])
	switch {
	case ah < bh || (ah == bh && al < bl):
		return -1
	case ah == bh && al == bl:
		return 0
	default:
		return 1
	}
}

// Of returns floor(n × f) exactly, for n ≥ 0.
func (f Fraction) Of(n int64) int64 {
	if n <= 0 || f.num == 0 {
		return 0
	}
	// n × num < 2^63 × 10^scale, so the high word is below the divisor.
	hi, lo := bits.Mul64(uint64(n), f.num)
	q, _ := bits.Div64(hi, lo, pow10[f.scale])
	return int64(q)
}

// Float64 returns the nearest float64, for scoring and display only.
func (f Fraction) Float64() float64 {
	return float64(f.num) / float64(pow10[f.scale])
}

// Decimals is the number of decimal places in f's shortest form.
func (f Fraction) Decimals() int { return int(f.scale) }

// String returns the shortest decimal form: "0.5", "1", "0".
func (f Fraction) String() string {
	if f.scale == 0 {
		return strconv.FormatUint(f.num, 10)
	}
	digits := strconv.FormatUint(f.num, 10)
	return "0." + strings.Repeat("0", int(f.scale)-len(digits)) + digits
}
