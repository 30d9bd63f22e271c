"""Generate the sample scientific-paper PDFs under samples/papers/.

    .venv/bin/python samples/make_samples.py            # (re)writes samples/papers/*.pdf and samples/papers.jsonl

The text of every paper is original to this project (Apache-2.0, see samples/README.md).
Layout features the PDF connector must undo:
  * two-column body (three of the four papers), full-width title / authors / abstract;
  * a running header on every page and a page number in the footer ("Page N of M" or "N");
  * words hyphenated across line ends by the line breaker below;
  * ligature glyphs (U+FB00..U+FB04) in the body of two papers, drawn with the built-in
    Times font through a TextWriter (the font is embedded and subset, so the glyphs render
    and the PDF's ToUnicode map carries the ligature code points).

The module is importable: tests read PAPERS (the source text) and ``layout_lines`` to
check extraction word by word.
"""

from __future__ import annotations

import dataclasses
import pathlib

import pymupdf

PAGE_W, PAGE_H = 612.0, 792.0  # US Letter, points
MARGIN_X = 64.0
BODY_TOP = 72.0
BODY_BOTTOM = 726.0
GUTTER = 22.0
HEADER_BASELINE = 38.0   # inside the top 6% of the page (47.5 pt)
FOOTER_BASELINE = 768.0  # inside the bottom 6% (from 744.5 pt)
BODY_SIZE = 11.0
LEADING = 13.6
PARA_GAP = 7.0
HEADING_SIZE = 12.0

LIGATURES = [("ffi", "\ufb03"), ("ffl", "\ufb04"), ("ff", "\ufb00"), ("fi", "\ufb01"), ("fl", "\ufb02")]


@dataclasses.dataclass(frozen=True)
class Paper:
    slug: str
    title: str
    authors: str
    header: str
    columns: int
    metadata_title: bool      # False: the extractor must find the title by font size
    ligatures: bool
    footer_style: str         # "page_of" -> "Page N of M"; "bare" -> "N"
    abstract: str
    sections: tuple[tuple[str, tuple[str, ...]], ...]
    references: tuple[str, ...] = ()

    def paragraphs(self) -> list[str]:
        """The source text in reading order: title, authors, abstract, headings, paragraphs
        (figure captions are paragraphs too), then the references heading and entries."""
        out = [self.title, self.authors, "Abstract", self.abstract]
        for heading, paras in self.sections:
            out.append(heading)
            out.extend(p.caption if isinstance(p, Figure) else p for p in paras)
        if self.references:
            out.append("References")
            out.extend(self.references)
        return out


@dataclasses.dataclass(frozen=True)
class Figure:
    """A figure inside a section: a drawn plot (no text) and its caption below it."""
    caption: str
    height: float = 96.0


PAGED = Paper(
    slug="paged_attention_batch",
    title="Paged Attention Memory for Offline Batch Inference",
    authors="R. Okafor, L. Brandt and S. Ito, Example Systems Group",
    header="Preprint - Paged Attention Memory for Offline Batch Inference",
    columns=2,
    metadata_title=True,
    ligatures=True,
    footer_style="page_of",
    abstract=(
        "Serving engines for large language models keep the attention key and value tensors of "
        "every running sequence in accelerator memory. When that memory is reserved as one "
        "contiguous region per sequence, most of it sits idle because output lengths are unknown "
        "in advance. We study a paged layout in which the cache is split into fixed-size blocks "
        "that are mapped to sequences through a small table, and we measure its effect on offline "
        "batch jobs where the full input set is known before the first request runs. Paging "
        "raises the number of concurrent sequences by a factor of three on our workloads and "
        "makes prefix sharing between requests nearly free."
    ),
    sections=(
        ("1 Introduction", (
            "Batch inference differs from interactive serving in one important way: the scheduler "
            "sees the whole queue. A summarization job over a library of scientific papers knows "
            "how long every document is, how many questions will be asked of it, and the maximum "
            "number of tokens each answer may contain. That knowledge is wasted if the memory "
            "allocator still behaves as if requests arrive one at a time and could grow without "
            "bound.",
            "The key and value cache dominates memory use during generation. For a model with "
            "thirty layers, eight key-value heads and a head dimension of one hundred and twenty "
            "eight, each token occupies roughly one hundred and twenty kilobytes in half precision. "
            "A document of six thousand tokens therefore pins more than seven hundred megabytes "
            "before a single output token is produced. Allocating that space in one piece per "
            "sequence leads to fragmentation that grows with the variance of sequence lengths.",
            "Paging borrows the oldest idea in operating systems. The cache is carved into blocks "
            "of sixteen tokens, a free list hands blocks out on demand, and each sequence keeps a "
            "block table that translates logical token positions into physical blocks. The attention "
            "kernel reads through this indirection, which costs a few percent of kernel time but "
            "removes external fragmentation entirely.",
        )),
        ("2 Design", (
            "Our allocator reserves blocks at admission time for the prompt and for the declared "
            "maximum output length. Because a batch job states its limits up front, a running "
            "sequence can never run out of space, and the engine never has to preempt work that is "
            "already in progress. Preemption by recomputation remains available as a fallback for "
            "jobs that underestimate their output budget.",
            "Blocks are reference counted. When two requests share a prefix, for example the same "
            "paper followed by different questions, the second request maps the first request's "
            "blocks into its own table and only allocates fresh blocks once the texts diverge. A "
            "chained hash over the token identifiers of each full block identifies reusable "
            "blocks in constant time, so the lookup adds no measurable overhead to scheduling.",
            "The scheduler works against a token budget per step. Prefill chunks and decode steps "
            "are packed into the same forward pass until the budget is spent, which keeps the "
            "accelerator busy while long prompts are still being ingested. Decode batches keep "
            "a fixed shape so that they can be captured once as a graph and replayed cheaply.",
        )),
        ("3 Evaluation", (
            "We ran three workloads: abstracts of physics papers, full-text biology papers, and a "
            "mixed corpus of legal filings. For each workload we compared contiguous allocation "
            "with paging at the same memory limit. Paging admitted between two point six and "
            "three point four times as many concurrent sequences, and end-to-end throughput rose "
            "by a similar factor on the two long-document workloads.",
            "Prefix sharing mattered most when several tasks were asked of the same document. With "
            "four tasks per paper the prefill work fell by seventy percent, because the document "
            "body was computed once and reused by every task. The remaining cost came from the "
            "task-specific instructions and from the generated answers themselves.",
            "The overhead of indirection was small. Kernel time grew by three percent for short "
            "sequences and by less than one percent for sequences longer than two thousand tokens, "
            "where the cost of reading the cache itself dominates the cost of the table lookups.",
            "We also measured how the block size affects these results. Blocks of eight tokens "
            "waste the least memory at the end of each sequence but double the size of the block "
            "tables, while blocks of sixty four tokens make the tables tiny and waste up to a few "
            "percent of the cache in partially filled blocks. Sixteen tokens was the best compromise "
            "on every workload we tried, and the differences between the settings stayed within "
            "five percent of throughput.",
        )),
        ("4 Limitations", (
            "Reservation at admission time assumes that the declared output limits are honest. A "
            "job that asks for four thousand output tokens but usually stops after two hundred "
            "reserves far more memory than it uses, and fewer sequences run at once. Our scheduler "
            "therefore keeps statistics of the actual output lengths per task and lowers the "
            "reservation for later requests once enough samples have been seen, falling back to "
            "recomputation when an estimate turns out to be too low.",
            "Prefix sharing only helps when the shared text is byte-for-byte identical after "
            "tokenization. Two copies of the same paper that differ in a single character near the "
            "start share almost nothing. Normalizing whitespace and ligatures before tokenization "
            "recovers most of these cases, which is why our document readers perform that cleanup "
            "before any prompt is built.",
            "Finally, the block table lives in host memory and is copied to the device for every "
            "step. With very large batches this copy becomes visible in profiles, and we plan to "
            "keep the tables resident on the device and update them incrementally.",
        )),
        ("5 Conclusion", (
            "Offline batch jobs reward allocators that exploit what is known in advance. Paging "
            "with admission-time reservation removes fragmentation, avoids preemption, and turns "
            "shared document prefixes into a free optimization. We expect the same structure to "
            "help disaggregated deployments, where cache blocks must also travel between machines.",
        )),
    ),
)

KV_TRANSFER = Paper(
    slug="kv_cache_transfer",
    title="Moving Attention Caches Between Unlike Accelerators",
    authors="M. Haddad and J. Lindqvist, Example Networking Lab",
    header="Workshop draft | KV cache transfer between unlike accelerators",
    columns=2,
    metadata_title=False,
    ligatures=False,
    footer_style="bare",
    abstract=(
        "Disaggregated inference runs the prompt phase and the generation phase on different "
        "machines. The attention cache computed during the prompt phase must therefore be "
        "shipped to the machine that generates the answer. We describe a payload format that "
        "carries the cache layer by layer together with a fingerprint of the model, and we "
        "compare three transports: a shared object store, same-host shared memory and direct "
        "device-to-device copies. Streaming the payload one layer at a time hides most of the "
        "transfer behind the remaining prompt computation."
    ),
    sections=(
        ("1 Motivation", (
            "The prompt phase of a transformer is limited by arithmetic throughput, while the "
            "generation phase is limited by memory bandwidth. Accelerators differ widely in the "
            "ratio between the two. Running each phase on the hardware that suits it can lower the "
            "cost per token substantially, but only if moving the cache between machines is cheap "
            "compared with recomputing it.",
            "A cache for one long document can reach hundreds of megabytes. At ten gigabytes per "
            "second that is a few tens of milliseconds, comparable to the time the prompt phase "
            "itself takes on a fast device. The transfer must therefore overlap with computation, "
            "and the format must be simple enough that the receiving side can place the data "
            "directly into its own cache blocks.",
        )),
        ("2 Payload Format", (
            "Each payload starts with a small header: a fingerprint of the model weights and "
            "configuration, the data type, the block size, the number of layers and the token "
            "count. The receiver refuses a payload whose fingerprint differs from its own model, "
            "which prevents subtle corruption when two pools are accidentally loaded with different "
            "checkpoints.",
            "After the header come the layers in order. For each layer the keys and values of all "
            "tokens are stored contiguously, independent of how the sender arranged its blocks. "
            "This costs one gather on the sending side and one scatter on the receiving side, "
            "but it lets two engines with different block sizes or memory layouts exchange caches "
            "without agreeing on anything beyond the header.",
            "When the data types differ, the receiver converts on arrival. Converting from sixteen "
            "bit floating point to a lower precision loses information, so the format records the "
            "source type and the receiver logs every lossy conversion it performs.",
        )),
        ("3 Transports", (
            "The object store transport writes each layer as a separate object and passes "
            "references to the receiver. It works across machines without special hardware and "
            "benefits from zero-copy reads on the same host. Shared memory is faster on a single "
            "host but needs careful naming so that concurrent workers never collide.",
            "Direct device copies use the interconnect between accelerators when one exists. They "
            "avoid staging the data in host memory and reach close to the link bandwidth for large "
            "payloads. For small payloads the fixed setup cost dominates, and the object store is "
            "often just as fast.",
            "In all three cases the sender streams layers as soon as they are computed. The first "
            "layers arrive while the last layers are still being produced, so the visible transfer "
            "time shrinks to the time needed for the final few layers. On our test machines this "
            "hid between sixty and ninety percent of the transfer.",
            "We measured each transport with payloads between one and five hundred megabytes. "
            "The object store reached about four gigabytes per second between two hosts on the "
            "same rack, shared memory about eleven gigabytes per second within a host, and direct "
            "device copies more than forty gigabytes per second where a fast interconnect existed. "
            "Each figure was compared with a plain memory copy on the same machine, which sets the "
            "upper limit any transport can reach.",
        )),
        ("4 Failure Handling", (
            "A generation worker may die while a payload is in flight, and a prompt worker may "
            "die after it has computed the cache but before the transfer completes. In the first "
            "case the payload is simply handed to another generation worker, because the payload "
            "is self-describing and does not depend on the receiver. In the second case the "
            "request is recomputed from the start on a different prompt worker.",
            "Payloads are reference counted by the object store and released once the receiver "
            "confirms that the blocks were copied into its cache. A payload that nobody claims "
            "within a configurable timeout is dropped and its request is scheduled again. This "
            "keeps memory bounded even when workers crash repeatedly during a long batch job.",
            "Partial payloads are never consumed. The header records the number of layers, and the "
            "receiver only starts generation once every layer has arrived and passed a length "
            "check, so a truncated stream leads to a retry rather than to silently wrong output.",
        )),
        ("5 Lessons", (
            "Most failures we observed came from mismatched configurations rather than from the "
            "network. Fingerprints caught every one of them. A second lesson is that the transport "
            "should be chosen per pair of workers: a single global choice is either too slow on "
            "some links or unavailable on others.",
        )),
    ),
)

SOLAR = Paper(
    slug="perovskite_solar_stability",
    title="Humidity Stability of Encapsulated Perovskite Solar Cells",
    authors="A. Mensah, P. Duarte and K. Novak, Example Materials Institute",
    header="Technical note: humidity stability of perovskite cells",
    columns=1,
    metadata_title=True,
    ligatures=True,
    footer_style="page_of",
    abstract=(
        "Metal halide perovskites convert sunlight to electricity with high efficiency, yet "
        "their performance degrades quickly in humid air. We compare four simple encapsulation "
        "schemes on identical cells stored at eighty five percent relative humidity for one "
        "thousand hours. A glass cover sealed with a butyl rubber edge kept ninety one percent of "
        "the initial efficiency, while thin polymer films alone kept less than half."
    ),
    sections=(
        ("Introduction", (
            "Perovskite absorbers can be deposited from solution at low temperature, which makes "
            "them attractive for inexpensive modules and for tandem cells stacked on silicon. Their "
            "weak point is stability. Water molecules penetrate the crystal lattice, form hydrated "
            "phases and eventually decompose the absorber into lead iodide, which appears as a "
            "yellow discoloration visible to the naked eye.",
            "Encapsulation is the usual defence, borrowed from the silicon industry. The question "
            "we address is which simple, low-cost schemes are sufficient for laboratory cells that "
            "must survive long outdoor tests without a full industrial lamination line.",
            "Industrial lamination uses heat and pressure that can damage the organic layers of a "
            "laboratory cell, so many groups fall back on improvised covers whose protection is "
            "poorly documented. A direct comparison under identical conditions has been missing, "
            "and this note aims to provide one.",
        )),
        ("Methods", (
            "All cells shared the same stack: a transparent conducting oxide, a tin oxide electron "
            "transport layer, a mixed cation perovskite absorber, an organic hole transport layer "
            "and a gold electrode. Forty cells were made in one batch and divided into four groups "
            "of ten, so that differences between groups reflect the encapsulation and not the "
            "fabrication.",
            "The four schemes were a spin-coated polymer film, a laminated polymer foil, a glass "
            "cover glued with an epoxy resin, and a glass cover sealed at the edges with butyl "
            "rubber containing a moisture getter. Cells were stored in a climate chamber at "
            "twenty five degrees and eighty five percent relative humidity and were measured under "
            "simulated sunlight every fifty hours.",
            "Current and voltage curves were recorded in both scan directions at a fixed rate, and "
            "the stabilized power output was tracked for sixty seconds at the maximum power point. "
            "We report the stabilized value, because perovskite cells often show a hysteresis that "
            "makes single scans look better than the cell really is. The light source was "
            "calibrated against a certified silicon reference cell before every measurement day.",
        )),
        ("Results", (
            "Unprotected reference cells lost half of their efficiency within the first day. Cells "
            "with a spin-coated polymer film lasted about two hundred hours before the same loss, "
            "and the laminated foil extended this to roughly four hundred hours. Both polymer "
            "schemes failed from the edges inward, where the film was thinnest.",
            "The epoxy-sealed glass covers performed much better, retaining seventy eight percent of "
            "the initial efficiency after one thousand hours. The butyl edge seal performed best, "
            "retaining ninety one percent. In the butyl group the spread between cells was also "
            "smallest, which suggests that the remaining losses are intrinsic to the absorber "
            "rather than caused by moisture.",
            "Optical inspection confirmed these trends. Yellow lead iodide appeared first at the "
            "corners of the polymer-coated cells and spread inward, whereas the glass-covered cells "
            "showed no visible change during the test.",
            "We also opened two cells from each group at the end of the test and examined their "
            "cross sections with an electron microscope. The absorber in the polymer groups had "
            "lost its grain structure near the edges, while the absorber under the butyl seal looked "
            "the same as in a fresh cell. The gold electrode showed small voids in every group, a "
            "known effect of metal migration that is independent of humidity.",
        )),
        ("Discussion", (
            "Edge sealing matters more than the barrier properties of the cover itself, because "
            "water enters most easily through the bond line between cover and substrate. A getter "
            "in the seal buys additional time by capturing the moisture that does diffuse in. For "
            "laboratories without lamination equipment, a butyl edge seal is a practical and "
            "affordable choice that makes long outdoor tests meaningful.",
            "Our study has clear limits. All cells came from one laboratory and one absorber "
            "recipe, the test used a constant temperature, and light soaking was not combined with "
            "humidity. Outdoor conditions add daily temperature cycles that stress the seals "
            "mechanically, and the ranking of the schemes could change under such cycling.",
        )),
        ("Outlook", (
            "We are now repeating the comparison with temperature cycles between minus twenty and "
            "plus sixty degrees and with continuous illumination. A second line of work replaces "
            "the gold electrode with carbon, which is cheaper and known to slow the ingress of "
            "water. If the butyl seal keeps its advantage under these harsher conditions, it would "
            "offer a simple route to field tests lasting several years.",
        )),
    ),
)

BIRDS = Paper(
    slug="songbird_migration_timing",
    title="Stopover Timing of Migrating Songbirds Along a Coastal Flyway",
    authors="E. Varga, T. Oduya and N. Castell, Example Ornithology Station",
    header="Field report - stopover timing of migrating songbirds",
    columns=2,
    metadata_title=False,
    ligatures=False,
    footer_style="page_of",
    abstract=(
        "Small songbirds cross long distances in a series of flights separated by stopovers, "
        "during which they rest and refuel. We tracked the stopover behaviour of three warbler "
        "species at a coastal ringing station over four autumn seasons using light radio tags "
        "and an array of automated receivers. Birds that arrived lean stayed almost twice as "
        "long as birds in good condition, and departures clustered on nights with following "
        "winds regardless of fuel load."
    ),
    sections=(
        ("1 Background", (
            "Migration is the most dangerous period of a songbird's year. A bird of ten grams may "
            "need to double its body mass before crossing open water, and it can only do so at "
            "sites that offer enough insects and cover. How long birds stay at such sites, and what "
            "triggers their departure, determines how quickly they complete the journey.",
            "Earlier studies relied on recaptures in mist nets, which miss most departures because "
            "birds leave at night. Automated radio telemetry changed this picture: a receiver "
            "network records every tagged bird that passes within a few kilometres, day and night, "
            "so the exact night of departure becomes observable.",
            "Two competing ideas explain departure decisions. The first holds that birds leave as "
            "soon as they have stored enough fuel for the next leg, whatever the weather. The "
            "second holds that weather sets the schedule and that fuel only decides whether a "
            "bird is able to use a favourable night when one comes. Telemetry lets us compare "
            "the two ideas directly, because it records departures that nets would never catch.",
        )),
        ("2 Methods", (
            "We caught birds in mist nets at a coastal peninsula during the autumn passage. Each "
            "bird was weighed, measured and scored for visible fat under the skin of the belly and "
            "the throat. Birds above a minimum body mass received a radio tag of less than three "
            "percent of their weight, attached with a leg-loop harness.",
            "Seven receiving stations around the peninsula recorded tag signals continuously. A "
            "departure was defined as the last detection at the station closest to the capture "
            "site followed by detections moving away along the coast or across the water. Weather "
            "data came from an airport station eleven kilometres away.",
            "In total we tagged four hundred and twelve birds of three species. Data from two "
            "hundred and ninety birds were complete enough to determine both the arrival condition "
            "and the departure night.",
            "We modelled stopover duration with survival models in which the daily chance of "
            "departure depends on fat score, wind direction, wind speed, rain and date. Species "
            "and year entered as grouping factors, so that birds from the same season were not "
            "treated as independent observations.",
        )),
        ("3 Results", (
            "Stopover duration depended strongly on arrival condition. Birds with little visible fat "
            "stayed a median of five days, while birds with moderate or high fat scores stayed a "
            "median of two to three days. Lean birds also gained mass faster once they began "
            "feeding, which suggests that the site offered enough food to compensate for their "
            "poor start.",
            "The timing of departure was dominated by weather. More than two thirds of all "
            "departures occurred on nights with winds blowing toward the south or south-west, and "
            "very few birds left during rain. Fat birds did not wait longer for good winds than "
            "lean ones; once a bird was ready, it left on the next favourable night.",
            "Departure direction also differed with condition. Birds in good condition more often "
            "headed directly across the water, while lean birds followed the coastline, a longer "
            "but safer route with more opportunities to land.",
            "Differences between the three species were smaller than expected. The largest of them "
            "stayed slightly longer on average, but once arrival condition was taken into account "
            "the species effect disappeared. Year-to-year differences were larger: in the one autumn "
            "with a long spell of easterly winds, median stopover rose by two days in every species.",
        )),
        ("4 Limitations", (
            "Tagging itself may change behaviour. We kept tag mass low and checked that tagged and "
            "untagged birds recaptured at the station gained mass at similar rates, but subtle "
            "effects on flight cannot be excluded. The receiver array also covers only the first "
            "few kilometres of each departure, so we cannot say where the birds stopped next.",
            "Fat scores are a coarse measure of condition. Future work will use quantitative "
            "magnetic resonance on a subset of birds to calibrate the visual scores, and will add "
            "receivers on the opposite coast to measure the duration of the water crossing itself.",
        )),
        ("5 Discussion", (
            "Our results support the view that songbirds adjust both the length of their stopover "
            "and the route they take to their own energy reserves. Protecting coastal stopover sites "
            "with good insect supply therefore benefits the birds that arrive in the worst "
            "condition, which are also those most at risk during the remaining journey.",
        )),
    ),
)

SHORT_PAPERS: tuple[Paper, ...] = (PAGED, KV_TRANSFER, SOLAR, BIRDS)


# ------------------------------------------------------------------ long papers
#
# Four papers of 9-20 pages, written by a deterministic text generator: a seeded
# random.Random per paper picks sentence templates and fills them from the paper's own
# vocabulary. The prose is plausible but says nothing real; it exists so the pipeline has
# documents of realistic length and structure (numbered sections and subsections, figure
# captions, a reference list) that exceed the default job's context.


@dataclasses.dataclass(frozen=True)
class Topic:
    slug: str
    title: str
    authors: str
    header: str
    target_words: int
    things: tuple[str, ...]      # what is studied (plural noun phrases)
    measures: tuple[str, ...]    # what is measured
    methods: tuple[str, ...]     # instruments / techniques
    factors: tuple[str, ...]     # what is varied
    places: tuple[str, ...]
    system: str                  # the paper's own approach
    methods_parts: tuple[str, str, str]
    results_parts: tuple[str, str, str]


_SENTENCES = (
    "We measured {measure} for {n} {thing} over {months} months and recorded {measure2} at the same time.",
    "The {method} gave readings of {measure} every {minutes} minutes, which was frequent enough to resolve daily cycles.",
    "Across all {thing}, {measure} rose by {pct} percent when {factor} was increased by one step.",
    "This effect was strongest at {place}, where {measure2} was already high at the start of the study.",
    "Earlier work treated {factor} as a nuisance variable, but our data suggest that it drives most of the variation in {measure}.",
    "We therefore designed {system} to account for {factor} explicitly rather than averaging it away.",
    "A simple linear model explained {pct} percent of the variance in {measure}, and adding {factor} raised this figure only slightly.",
    "The residuals showed no trend with {factor}, which indicates that the model captures its main influence.",
    "At {place} the {method} failed on {small} occasions, and we excluded the affected days from the analysis.",
    "Repeating the analysis without these exclusions changed none of the conclusions.",
    "The relation between {measure} and {measure2} was close to monotonic over the whole range we observed.",
    "Outliers came almost entirely from {thing} that had been disturbed during maintenance visits.",
    "We compared {system} with two simpler baselines that ignore {factor}.",
    "Both baselines predicted {measure} well on average but missed the extremes by a wide margin.",
    "For planning purposes the extremes matter more than the average, because they set the margins that operators must keep.",
    "The uncertainty of each estimate was obtained by resampling whole {thing} rather than single observations.",
    "Resampling single observations would understate the uncertainty, since readings taken close together are strongly correlated.",
    "On average {system} reduced the error in {measure} from {big} to {mid} units.",
    "The improvement held at every site except {place}, where the record was too short to judge.",
    "We also asked whether {measure2} could replace {measure} as the main indicator, since it is cheaper to record.",
    "The answer depends on the season: the two agree closely in summer and diverge in winter.",
    "Operators who already record {measure2} can therefore use it as a proxy for most of the year.",
    "Calibration of the {method} was checked before and after each campaign against a reference instrument.",
    "The drift between the two checks stayed below {small} percent, which is small compared with the effects we report.",
    "To keep the study comparable with earlier campaigns, we used the same sampling protocol at every site.",
    "Data collection was organised in {small} rounds, each lasting about {weeks} weeks.",
    "Within each round the order in which {thing} were visited was randomised.",
    "This protects the comparison against slow changes in weather or staffing during a round.",
    "The strongest single predictor of {measure} was {factor}, followed at some distance by the age of the installation.",
    "Interactions between {factor} and {factor2} were weak and did not survive correction for multiple comparisons.",
    "We note that {factor2} varied little between our sites, so a larger study could still find an effect.",
    "Figure {fig} summarises the relation for the three largest groups of {thing}.",
    "In practice the gain from {system} comes at almost no cost, because it uses data that are collected anyway.",
    "The main cost lies in keeping the {method} calibrated, which takes a technician about {small} hours per month.",
    "Several readers of an early draft asked how the results transfer to other regions.",
    "We expect the qualitative pattern to hold wherever {factor} varies as widely as it does here.",
    "The exact coefficients, however, are specific to our sites and should be estimated anew elsewhere.",
    "All processing steps are deterministic and were run twice on separate machines with identical results.",
    "The raw records, the processing scripts and the fitted models are archived with the station's data office.",
    "A sensitivity analysis varied each assumption in turn and recorded the change in the main estimate.",
    "No single assumption moved the estimate by more than {small} percent.",
    "The largest changes came from the treatment of missing days, which we discuss below.",
    "Missing days were filled by interpolation when the gap was shorter than {small} days and left empty otherwise.",
    "Longer gaps occurred mainly in the first year, before the {method} had been fitted with backup power.",
    "Taken together, these checks suggest that the main result is robust to reasonable changes in the analysis.",
)

_CAPTIONS = (
    "Figure {fig}: {Measure} against {factor} for {thing} at {place}. Each point is one weekly mean; the line is the fit of {system}.",
    "Figure {fig}: Distribution of {measure2} in the {small} measurement rounds. Boxes span the middle half of the values.",
    "Figure {fig}: Error of {system} and of the two baselines in predicting {measure}, by site.",
    "Figure {fig}: Seasonal cycle of {measure} and {measure2} averaged over all {thing}.",
)

_SURNAMES = ("Adeyemi", "Bergstrom", "Castillo", "Dumont", "Eriksen", "Fujita", "Gallo", "Hartmann", "Ivanova",
             "Jensen", "Kowalski", "Lindgren", "Moreau", "Nakamura", "Ortega", "Petrov", "Quinn", "Rossi",
             "Sato", "Tanaka", "Uribe", "Vogel", "Weber", "Yilmaz", "Zhou")
_VENUES = ("Journal of Example Field Studies", "Example Letters in Applied Measurement",
           "Proceedings of the Example Workshop on Data and Methods", "Annals of Invented Research",
           "Example Review of Instruments and Models")


def _fill(template: str, t: Topic, rng, fig: int = 1) -> str:
    measure, measure2 = rng.sample(t.measures, 2)
    factor, factor2 = rng.sample(t.factors, 2)
    text = template.format(
        measure=measure, measure2=measure2, Measure=measure[0].upper() + measure[1:],
        factor=factor, factor2=factor2, thing=rng.choice(t.things), method=rng.choice(t.methods),
        place=rng.choice(t.places), system=t.system, n=rng.randint(12, 240), months=rng.randint(6, 36),
        minutes=rng.choice((5, 10, 15, 30)), pct=rng.randint(4, 61), small=rng.randint(2, 9),
        weeks=rng.randint(2, 6), big=f"{rng.uniform(2.0, 9.0):.1f}", mid=f"{rng.uniform(0.5, 1.9):.1f}", fig=fig)
    return text[0].upper() + text[1:]


def _paragraph(t: Topic, rng) -> str:
    picks = rng.sample(range(len(_SENTENCES)), rng.randint(4, 7))
    return " ".join(_fill(_SENTENCES[i], t, rng) for i in picks if "{fig}" not in _SENTENCES[i]) \
        or _fill(_SENTENCES[0], t, rng)


def _reference(t: Topic, rng, number: int) -> str:
    names = rng.sample(_SURNAMES, rng.randint(1, 3))
    authors = " and ".join(f"{rng.choice('ABCDEFGHJKLMNPRST')}. {n}" for n in names)
    words = f"{rng.choice(t.measures)} and {rng.choice(t.factors)} in {rng.choice(t.things)}"
    title = words[0].upper() + words[1:]
    year = rng.randint(1994, 2025)
    first = rng.randint(1, 400)
    return (f"[{number}] {authors}. {title}. {rng.choice(_VENUES)}, volume {rng.randint(3, 60)}, "
            f"pages {first} to {first + rng.randint(6, 30)}, {year}.")


def long_paper(t: Topic) -> Paper:
    """The generated paper of a topic; deterministic (seeded by the slug)."""
    import random

    rng = random.Random(f"dlbatch-sample-{t.slug}")
    m1, m2, m3 = t.methods_parts
    r1, r2, r3 = t.results_parts
    # (heading, share of the paragraphs, figures in it)
    plan = (("1 Introduction", 0.10, 0), ("2 Related Work", 0.08, 0), ("3 Methods", 0.02, 0),
            (f"3.1 {m1}", 0.08, 1), (f"3.2 {m2}", 0.08, 0), (f"3.3 {m3}", 0.07, 0), ("4 Results", 0.02, 0),
            (f"4.1 {r1}", 0.11, 1), (f"4.2 {r2}", 0.10, 1), (f"4.3 {r3}", 0.09, 1), ("5 Discussion", 0.12, 0),
            ("6 Limitations", 0.07, 0), ("7 Conclusion", 0.06, 0))
    total_paras = t.target_words // 100
    fig = 0
    sections = []
    for heading, share, figures in plan:
        paras: list = [_paragraph(t, rng) for _ in range(max(1, round(share * total_paras)))]
        for _ in range(figures):
            fig += 1
            paras.insert(min(2, len(paras)), Figure(_fill(rng.choice(_CAPTIONS), t, rng, fig=fig)))
        sections.append((heading, tuple(paras)))
    abstract = " ".join(_fill(_SENTENCES[i], t, rng) for i in (0, 5, 2, 17, 44))
    refs = tuple(_reference(t, rng, n) for n in range(1, rng.randint(14, 22)))
    return Paper(slug=t.slug, title=t.title, authors=t.authors, header=t.header, columns=2,
                 metadata_title=True, ligatures=False, footer_style="page_of", abstract=abstract,
                 sections=tuple(sections), references=refs)


LONG_TOPICS = (
    Topic(slug="rainfed_wheat_soil_moisture", title="Soil Moisture Memory and Grain Yield in Rainfed Wheat",
          authors="A. Mensah, K. Lund and P. Duarte, Example Agronomy Institute",
          header="Example Agronomy Reports - soil moisture memory in rainfed wheat", target_words=7000,
          things=("wheat plots", "field strips", "trial fields", "farm sites"),
          measures=("grain yield", "soil moisture", "root depth", "leaf area", "water use", "canopy temperature"),
          methods=("neutron probe", "capacitance sensor", "weather station", "yield monitor"),
          factors=("sowing date", "autumn rainfall", "stubble cover", "soil depth", "nitrogen rate"),
          places=("the northern terrace", "the river flat", "the upland site", "the clay basin"),
          system="the moisture memory model",
          methods_parts=("Field Sites", "Sensor Network", "Statistical Model"),
          results_parts=("Moisture Carryover", "Yield Response", "Model Comparison")),
    Topic(slug="tidal_array_wakes", title="Wake Interaction and Annual Yield in Small Tidal Turbine Arrays",
          authors="H. Sorensen and B. Achebe, Example Marine Energy Centre",
          header="Example Marine Energy Centre technical paper - tidal array wakes", target_words=8500,
          things=("turbines", "array rows", "rotor pairs", "mooring units"),
          measures=("power output", "flow speed", "wake deficit", "blade load", "turbulence intensity",
                    "capacity factor"),
          methods=("acoustic current profiler", "strain gauge", "power logger", "pressure sensor"),
          factors=("row spacing", "tidal range", "lateral offset", "hub depth", "flow direction"),
          places=("the narrow channel", "the outer sound", "the harbour mouth", "the shallow bank"),
          system="the staggered layout",
          methods_parts=("Array Layout", "Instrumentation", "Wake Model"),
          results_parts=("Wake Recovery", "Energy Yield", "Structural Loads")),
    Topic(slug="urban_heat_islands", title="A Four-Year Study of Urban Heat Islands in Mid-Sized Cities",
          authors="L. Moreno, S. Petrova, D. Kim and F. Osei, Example Climate Laboratory",
          header="Example Climate Laboratory working paper - urban heat islands", target_words=10500,
          things=("street canyons", "city blocks", "parks", "residential districts"),
          measures=("air temperature", "surface temperature", "night cooling rate", "humidity",
                    "tree cover", "heat stress index"),
          methods=("roof station", "mobile transect", "satellite scene", "thermal camera"),
          factors=("building height", "green area", "street orientation", "wind speed", "paving material"),
          places=("the old town", "the harbour district", "the eastern suburbs", "the university quarter"),
          system="the block scale model",
          methods_parts=("Study Cities", "Measurement Network", "Data Processing"),
          results_parts=("Night Cooling", "Green Space Effects", "Heat Stress Days")),
    Topic(slug="long_context_batch_serving", title="Serving Long Documents in Offline Batch Inference",
          authors="Y. Chen, O. Nwosu, M. Keller and R. Alvarez, Example Systems Laboratory",
          header="Example Systems Laboratory report - long documents in batch inference", target_words=13000,
          things=("documents", "request batches", "worker pools", "cache blocks"),
          measures=("prefill time", "peak memory", "answer quality", "token throughput", "queue delay",
                    "cache hit rate"),
          methods=("trace recorder", "memory profiler", "benchmark harness", "request logger"),
          factors=("chunk size", "context length", "batch size", "overlap between chunks", "number of tasks"),
          places=("the small cluster", "the shared test machine", "the production pool", "the laptop setup"),
          system="the chunked map reduce plan",
          methods_parts=("Workloads", "Chunking Policy", "Measurement Setup"),
          results_parts=("Throughput", "Memory", "Answer Quality")),
)

LONG_PAPERS: tuple[Paper, ...] = tuple(long_paper(t) for t in LONG_TOPICS)

PAPERS: tuple[Paper, ...] = SHORT_PAPERS + LONG_PAPERS


# ------------------------------------------------------------------ line breaking

_FONT_CACHE: dict[str, pymupdf.Font] = {}


def font(name: str) -> pymupdf.Font:
    if name not in _FONT_CACHE:
        _FONT_CACHE[name] = pymupdf.Font(name)
    return _FONT_CACHE[name]


def _hyphen_split(word: str, room: float, fnt: pymupdf.Font, size: float) -> tuple[str, str] | None:
    """Split a plain lowercase word so that ``head + '-'`` fits into ``room``; None if not."""
    core = word.rstrip(".,;:")
    if len(core) < 8 or not core.isalpha() or not core.islower():
        return None
    vowels = set("aeiouy")
    for cut in range(len(core) - 3, 3, -1):  # keep >= 4 letters before, >= 3 after
        head = word[:cut]
        # a syllable-like break: after a vowel before a consonant, or between a double letter
        syllable = (core[cut - 1] in vowels and core[cut] not in vowels) or core[cut - 1] == core[cut]
        if syllable and fnt.text_length(head + "-", fontsize=size) <= room:
            return head, word[cut:]
    return None


def layout_lines(text: str, width: float, fnt: pymupdf.Font, size: float,
                 hyphenate: bool = True) -> list[str]:
    """Greedy line breaking with hyphenation of long lowercase words at line ends."""
    words = text.split()
    lines: list[str] = []
    current = ""
    i = 0
    while i < len(words):
        word = words[i]
        trial = f"{current} {word}" if current else word
        if fnt.text_length(trial, fontsize=size) <= width:
            current = trial
            i += 1
            continue
        if current and hyphenate:
            room = width - fnt.text_length(current + " ", fontsize=size)
            split = _hyphen_split(word, room, fnt, size)
            if split is not None:
                lines.append(f"{current} {split[0]}-")
                current = ""
                words[i] = split[1]
                continue
        if not current:  # a single word longer than the line: place it anyway
            lines.append(word)
            i += 1
            continue
        lines.append(current)
        current = ""
    if current:
        lines.append(current)
    return lines


def ligate(line: str) -> str:
    for plain, lig in LIGATURES:
        line = line.replace(plain, lig)
    return line


# ------------------------------------------------------------------ page drawing

class _Writer:
    def __init__(self, doc: pymupdf.Document, paper: Paper):
        self.doc = doc
        self.paper = paper
        self.pages: list[pymupdf.TextWriter] = []  # one writer per page, drawn at the end
        self.col = 0
        self.y = BODY_TOP
        self.col_top = BODY_TOP
        self.new_page()

    @property
    def col_width(self) -> float:
        full = PAGE_W - 2 * MARGIN_X
        return full if self.paper.columns == 1 else (full - GUTTER) / 2

    def col_x(self) -> float:
        return MARGIN_X + self.col * (self.col_width + GUTTER)

    def new_page(self) -> None:
        page = self.doc.new_page(width=PAGE_W, height=PAGE_H)
        self.pages.append(pymupdf.TextWriter(page.rect))
        self.col = 0
        self.y = self.col_top = BODY_TOP

    @property
    def tw(self) -> pymupdf.TextWriter:
        return self.pages[-1]

    def advance_column(self) -> None:
        if self.col + 1 < self.paper.columns:
            self.col += 1
            self.y = self.col_top
        else:
            self.new_page()

    def put_line(self, text: str, fnt: pymupdf.Font, size: float, leading: float,
                 x: float | None = None) -> None:
        if self.y + leading > BODY_BOTTOM:
            self.advance_column()
        self.y += leading
        if self.paper.ligatures and fnt is font("tiro"):
            text = ligate(text)
        self.tw.append((self.col_x() if x is None else x, self.y), text, font=fnt, fontsize=size)

    def full_width_block(self, text: str, fnt: pymupdf.Font, size: float, leading: float,
                         centered: bool) -> None:
        width = PAGE_W - 2 * MARGIN_X
        for line in layout_lines(text, width, fnt, size, hyphenate=not centered):
            x = MARGIN_X + (width - fnt.text_length(line, fontsize=size)) / 2 if centered else MARGIN_X
            self.y += leading
            self.tw.append((x, self.y), line, font=fnt, fontsize=size)

    def paragraph(self, text: str) -> None:
        for line in layout_lines(text, self.col_width, font("tiro"), BODY_SIZE):
            self.put_line(line, font("tiro"), BODY_SIZE, LEADING)
        self.y += PARA_GAP

    def figure(self, fig: "Figure") -> None:
        """A plot drawn as vector shapes (no text), then its caption in small italics."""
        caption = layout_lines(fig.caption, self.col_width, font("tiit"), 9.0, hyphenate=False)
        if self.y + fig.height + 11 * len(caption) + 6 > BODY_BOTTOM:
            self.advance_column()
        page = self.doc[-1]
        x0, top = self.col_x(), self.y + 6
        box = pymupdf.Rect(x0 + 8, top, x0 + self.col_width - 8, top + fig.height - 10)
        page.draw_rect(box, color=(0.3, 0.3, 0.3), width=0.6)
        steps = 12
        points = [(box.x0 + i * box.width / steps,
                   box.y1 - box.height * (0.15 + 0.7 * ((i * 7919) % 13) / 13)) for i in range(steps + 1)]
        page.draw_polyline(points, color=(0.1, 0.2, 0.6), width=0.9)
        self.y = top + fig.height
        for line in caption:
            self.put_line(line, font("tiit"), 9.0, 11.0)
        self.y += PARA_GAP

    def reference(self, text: str) -> None:
        for line in layout_lines(text, self.col_width, font("tiro"), 9.0, hyphenate=False):
            self.put_line(line, font("tiro"), 9.0, 11.0)
        self.y += 6.0

    def heading(self, text: str) -> None:
        if self.y + 3 * LEADING > BODY_BOTTOM:  # keep a heading with its first lines
            self.advance_column()
        self.y += 4
        self.put_line(text, font("tibo"), HEADING_SIZE, LEADING + 2)
        self.y += 3

    def finish(self) -> None:
        total = len(self.pages)
        for number, tw in enumerate(self.pages, start=1):
            page = self.doc[number - 1]
            hdr = self.paper.header
            size = 8.5
            x = (PAGE_W - font("tiit").text_length(hdr, fontsize=size)) / 2
            tw.append((x, HEADER_BASELINE), hdr, font=font("tiit"), fontsize=size)
            foot = f"Page {number} of {total}" if self.paper.footer_style == "page_of" else str(number)
            x = (PAGE_W - font("tiro").text_length(foot, fontsize=9)) / 2
            tw.append((x, FOOTER_BASELINE), foot, font=font("tiro"), fontsize=9)
            tw.write_text(page)
            # a thin rule under the header, as journals draw it
            page.draw_line((MARGIN_X, HEADER_BASELINE + 5), (PAGE_W - MARGIN_X, HEADER_BASELINE + 5),
                           width=0.4)


def build_pdf(paper: Paper) -> bytes:
    doc = pymupdf.open()
    w = _Writer(doc, paper)
    w.y = BODY_TOP - 6
    w.full_width_block(paper.title, font("tibo"), 18, 22, centered=True)
    w.y += 6
    w.full_width_block(paper.authors, font("tiit"), 11, 14, centered=True)
    w.y += 14
    w.full_width_block("Abstract", font("tibo"), 11, 14, centered=False)
    w.full_width_block(paper.abstract, font("tiro"), 10, 12.5, centered=False)
    w.y += 16
    w.col_top = w.y  # columns of page 1 start below the abstract
    for heading, paras in paper.sections:
        w.heading(heading)
        for para in paras:
            if isinstance(para, Figure):
                w.figure(para)
            else:
                w.paragraph(para)
    if paper.references:
        w.heading("References")
        for entry in paper.references:
            w.reference(entry)
    w.finish()
    meta = {"title": paper.title if paper.metadata_title else "", "author": paper.authors,
            "subject": "dlbatch sample paper", "creator": "samples/make_samples.py",
            "producer": "PyMuPDF", "creationDate": "", "modDate": ""}
    doc.set_metadata(meta)
    doc.subset_fonts()
    return doc.tobytes(garbage=4, deflate=True, deflate_fonts=True, no_new_id=True)


def word_count(paper: Paper) -> int:
    return sum(len(p.split()) for p in paper.paragraphs())


def write_jsonl(path: pathlib.Path) -> pathlib.Path:
    """The same papers as JSON Lines (``id``, ``title``, ``text``: the source text in reading
    order, paragraphs separated by blank lines), the input of jobs/papers_jsonl.yaml."""
    import json

    with open(path, "w", encoding="utf-8") as f:
        for paper in PAPERS:
            body = "\n\n".join(paper.paragraphs()[1:])
            f.write(json.dumps({"id": paper.slug, "title": paper.title, "text": body}, ensure_ascii=False) + "\n")
    print(f"{path.name}: {len(PAPERS)} papers as JSON Lines")
    return path


def main(out_dir: pathlib.Path | None = None) -> list[pathlib.Path]:
    write_jsonl(pathlib.Path(__file__).resolve().parent / "papers.jsonl")
    out_dir = out_dir or pathlib.Path(__file__).resolve().parent / "papers"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for paper in PAPERS:
        data = build_pdf(paper)
        path = out_dir / f"{paper.slug}.pdf"
        path.write_bytes(data)
        pages = pymupdf.open(stream=data, filetype="pdf").page_count
        print(f"{path.name}: {pages} pages, {word_count(paper)} words, {len(data) // 1024} KiB")
        written.append(path)
    return written


if __name__ == "__main__":
    main()
