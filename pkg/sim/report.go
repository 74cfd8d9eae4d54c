package sim

import (
	"encoding/csv"
	"fmt"
	"image/color"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// MaxArrived is the last arrived-workload percent the study reports.
const MaxArrived = 130

// WriteCurves writes every run's discrete curve as CSV: policy, seed,
// arrived %, allocation %, fragmentation amount % and fragmentation rate
// %.
func WriteCurves(w io.Writer, results []Result) error {
	cw := csv.NewWriter(w)
	_ = cw.Write([]string{"policy", "seed", "arrived_pct", "alloc_pct", "frag_amount_pct", "frag_rate_pct"})
	for _, r := range results {
		c := r.Discrete(MaxArrived)
		for i, a := range c.Arrived {
			_ = cw.Write([]string{r.Policy, strconv.FormatInt(r.Seed, 10), strconv.Itoa(a),
				ff(c.Alloc[i]), ff(c.Frag[i]), ff(c.FragRate[i])})
		}
	}
	cw.Flush()
	return cw.Error()
}

func ff(v float64) string { return strconv.FormatFloat(v, 'f', 2, 64) }

// Published is the study's mean allocation curve per policy for one
// trace: allocation % by arrived % (NaN where it has none).
type Published map[string][]float64

// LoadPublished reads the study's analysis_allo_discrete.csv and keeps
// the trace's rows (workload is the pod file's name without .csv),
// averaging each policy's seeds. Policies are named as the study names
// them ("06-FGD").
func LoadPublished(r io.Reader, workload string) (Published, error) {
	rows, err := csv.NewReader(r).ReadAll()
	if err != nil {
		return nil, err
	}
	if len(rows) == 0 || len(rows[0]) < 5 || rows[0][0] != "workload" || rows[0][1] != "sc_policy" {
		return nil, fmt.Errorf("not the study's allocation table (want a workload,sc_policy,... header)")
	}
	col := map[int]int{}
	for i, h := range rows[0] {
		if pct, err := strconv.Atoi(h); err == nil && pct >= 0 && pct <= MaxArrived {
			col[i] = pct
		}
	}
	sums, counts := map[string][]float64{}, map[string][]int{}
	for _, row := range rows[1:] {
		if len(row) != len(rows[0]) || row[0] != workload {
			continue
		}
		policy := row[1]
		if sums[policy] == nil {
			sums[policy], counts[policy] = make([]float64, MaxArrived+1), make([]int, MaxArrived+1)
		}
		for i, pct := range col {
			if v, err := strconv.ParseFloat(row[i], 64); err == nil {
				sums[policy][pct] += v
				counts[policy][pct]++
			}
		}
	}
	out := Published{}
	for policy, s := range sums {
		mean := make([]float64, MaxArrived+1)
		for pct := range mean {
			mean[pct] = math.NaN()
			if n := counts[policy][pct]; n > 0 {
				mean[pct] = s[pct] / float64(n)
			}
		}
		out[policy] = mean
	}
	return out, nil
}

// PlotAllocation draws allocation against arrived workload, one line per
// policy (the mean of its seeds), plus the study's published FGD curve
// when given, as a PNG.
func PlotAllocation(w io.Writer, title string, results []Result, published Published) error {
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = "arrived workload (% of GPU capacity)"
	p.Y.Label.Text = "GPUs allocated (%)"
	p.X.Min, p.X.Max = 0, MaxArrived
	p.Y.Min, p.Y.Max = 0, 100
	p.Legend.Top, p.Legend.Left = false, false
	p.Legend.XOffs, p.Legend.YOffs = -vg.Points(10), vg.Points(10)
	p.Add(plotter.NewGrid())
	var policies []string
	byPolicy := map[string][]Result{}
	for _, r := range results {
		if byPolicy[r.Policy] == nil {
			policies = append(policies, r.Policy)
		}
		byPolicy[r.Policy] = append(byPolicy[r.Policy], r)
	}
	for i, policy := range policies {
		line, err := plotter.NewLine(meanCurve(byPolicy[policy]))
		if err != nil {
			return err
		}
		line.Color = plotColor(i)
		line.Width = vg.Points(1.5)
		p.Add(line)
		p.Legend.Add(fmt.Sprintf("%s (%d seeds)", policy, len(byPolicy[policy])), line)
	}
	if fgd := published["06-FGD"]; fgd != nil {
		var pts plotter.XYs
		for pct, v := range fgd {
			if !math.IsNaN(v) {
				pts = append(pts, plotter.XY{X: float64(pct), Y: v})
			}
		}
		line, err := plotter.NewLine(pts)
		if err != nil {
			return err
		}
		line.Color = color.Black
		line.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
		p.Add(line)
		p.Legend.Add("FGD, published (ATC '23)", line)
	}
	c := vgimg.New(8*vg.Inch, 5*vg.Inch)
	p.Draw(draw.New(c))
	_, err := vgimg.PngCanvas{Canvas: c}.WriteTo(w)
	return err
}

// meanCurve averages the runs' allocation at each arrived percent.
func meanCurve(runs []Result) plotter.XYs {
	sum := make([]float64, MaxArrived+1)
	n := make([]int, MaxArrived+1)
	for _, r := range runs {
		c := r.Discrete(MaxArrived)
		for i, a := range c.Arrived {
			sum[a] += c.Alloc[i]
			n[a]++
		}
	}
	var pts plotter.XYs
	for pct := range sum {
		if n[pct] > 0 {
			pts = append(pts, plotter.XY{X: float64(pct), Y: sum[pct] / float64(n[pct])})
		}
	}
	return pts
}

func plotColor(i int) color.Color {
	palette := []color.RGBA{{0xd6, 0x27, 0x28, 0xff}, {0x1f, 0x77, 0xb4, 0xff}, {0x2c, 0xa0, 0x2c, 0xff},
		{0xff, 0x7f, 0x0e, 0xff}, {0x94, 0x67, 0xbd, 0xff}, {0x8c, 0x56, 0x4b, 0xff}}
	return palette[i%len(palette)]
}

// ParseSeeds reads a seed list such as "42-51" or "42,45,50-51".
func ParseSeeds(s string) ([]int64, error) {
	var seeds []int64
	for part := range strings.SplitSeq(s, ",") {
		lo, hi, isRange := strings.Cut(strings.TrimSpace(part), "-")
		a, err := strconv.ParseInt(lo, 10, 64)
		b := a
		if err == nil && isRange {
			b, err = strconv.ParseInt(hi, 10, 64)
		}
		if err != nil || b < a || b-a > 10000 {
			return nil, fmt.Errorf("seeds %q: %q must be a whole number or a range low-high, such as 42-51", s, part)
		}
		for seed := a; seed <= b; seed++ {
			if !slices.Contains(seeds, seed) {
				seeds = append(seeds, seed)
			}
		}
	}
	return seeds, nil
}
